"""A training loop with no torch optimizer: the weights are updated by hand (as pytorch/examples'
word_language_model does, p.data.add_(p.grad, alpha=-lr)), gradients clipped by the script.

--lr 1e30 drives the weights to inf at the first update (step 0's optimizer phase), and the
forward of step 1 is NaN. Prints one line per step: ``step N loss L``.
"""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
x, y = torch.randn(32, 8), torch.randn(32, 1)
for step in range(args.steps):
    model.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-args.lr)
    print(f"step {step} loss {loss.item()!r}")
