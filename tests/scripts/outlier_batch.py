"""An MLP regression in float32 whose step 8 batch holds wildly scaled records (x 300): its loss
and gradient are huge, SGD's update wrecks the weights, and the loss never comes back. Nothing
is non-finite (the exploding-gradient rule fires at step 12, four steps later).

``--replace N``: step N's batch (features and targets) replaced by step N-1's by hand, which is
what ``--fix skip-batch=N`` does from outside."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--replace", type=int, default=None)
args = parser.parse_args()
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
w = torch.randn(16, 1) / 4
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x = torch.randn(32, 16, generator=g)
    if step == 8:
        x = x * 300  # records in the wrong units
    y = x @ w
    if step == args.replace:
        x, y = previous
    previous = x, y
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
