"""Fails: one corrupt record in the data set: the batch of step 3 holds a NaN (sample 5, feature 2).

Expected first non-finite value:
  step 3 (0-based), phase data, the input batch x (the model's input[0], shape [8, 12]):
  exactly one NaN, at sample index 5, feature 2 (data set row 29).  Everything before it is finite.
Then, in the same step, the forward is NaN from the first layer ("body.0", nn.Linear, output row 5)
on, the loss is NaN, the backward is NaN and GradScaler skips step 3 (scale 65536 -> 32768).
All other steps are finite everywhere and the run goes on (only step 3 prints loss nan).
Fix: clean/validate the data (e.g. assert torch.isfinite(x).all() in the loader).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self, d_in=12, d_hidden=32, n_classes=3):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_hidden), nn.ReLU()
        )
        self.head = nn.Linear(d_hidden, n_classes)

    def forward(self, x):
        return self.head(self.body(x))


def make_dataset(n=512, d_in=12, n_classes=3):
    x = torch.randn(n, d_in)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    y = y.clamp(max=n_classes - 1)
    x[3 * 8 + 5, 2] = float("nan")  # a corrupt record: batch 3, sample 5
    return TensorDataset(x, y)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    loader = DataLoader(make_dataset(), batch_size=8, shuffle=False)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")

    for step, (x, y) in enumerate(loader):
        if step >= args.steps:
            break
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
