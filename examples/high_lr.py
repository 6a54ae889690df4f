"""Fails: the learning rate is far too high, so the head's weights blow up in the optimizer step.

Pure fp16 training (model.half(), no autocast, no GradScaler: nothing would skip a bad step).
Only the head is trained (fc is a frozen feature extractor, norm keeps its output bounded).
Expected first non-finite value:
  step 2 (0-based), phase optimizer, parameter "head.weight" (module "head", nn.Linear), +/-inf
  right after optimizer.step(): the SGD update lr * grad (~1.2e5) exceeds 65504
  ("head.bias" becomes inf in the same update).
Before that update everything of steps 0-2 is finite: loss ~4.5e7 (fp32), head output amax ~1.5e4,
head.weight.grad amax ~1e4.  Each step multiplies the error by ~50.  From step 3 on the forward
is NaN and the loss prints nan.
Fix: lower the learning rate (--lr 0.01 trains fine).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Regressor(nn.Module):
    def __init__(self, d_in=8, d_hidden=16):
        super().__init__()
        self.fc = nn.Linear(d_in, d_hidden)
        self.norm = nn.LayerNorm(d_hidden, elementwise_affine=False)
        self.head = nn.Linear(d_hidden, 1)

    def forward(self, x):
        return self.head(self.norm(self.fc(x)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=12.0)
    args = parser.parse_args()

    x_all = torch.randn(256, 8)
    y_all = x_all @ torch.randn(8, 1) + 0.1 * torch.randn(256, 1)
    model = Regressor().half()
    model.fc.requires_grad_(False)  # frozen feature extractor: only the head is trained
    optimizer = torch.optim.SGD(model.head.parameters(), lr=args.lr)

    for step in range(args.steps):
        idx = torch.arange(step * 32, (step + 1) * 32) % len(x_all)
        x, y = x_all[idx].half(), y_all[idx]
        optimizer.zero_grad()
        pred = model(x)
        loss = F.mse_loss(pred.float(), y)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
