"""Fails: an MLP trained with SGD at a learning rate far too high diverges: the loss grows step
after step and overflows to inf/NaN (in float32 as in float16). Not a precision problem: a
learning rate 10x lower trains. Prints ``step N loss X``.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 16, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=1.5)
    args = p.parse_args()
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x, y = batch(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
