"""Fails: raw 16-bit pixel counts (0-65535) fed to a CNN under float16 autocast.

A microscopy-style classifier reads uint16 images and converts them with .float() but never
scales them to [0, 1] or standardises them. Under autocast the first conv runs in float16: its
input (up to 65535, and float16's max is 65504) and the conv's sums overflow to inf at step 0.
--normalize divides by 65535 and standardises: trains. --fp32 trains without autocast (the
float32 control: finite, large but fine).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 16, 5, padding=2)
        self.conv = nn.Conv2d(16, 32, 3, padding=1)
        self.bn = nn.BatchNorm2d(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.stem(x)), 2)
        x = F.relu(self.bn(self.conv(x)))
        return self.head(x.mean(dim=(2, 3)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--normalize", action="store_true")
    parser.add_argument("--fp32", action="store_true")
    args = parser.parse_args()

    counts = torch.randint(0, 65536, (64, 1, 16, 16), dtype=torch.int32)  # uint16 pixel counts
    labels = torch.randint(0, 4, (64,))
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=not args.fp32)

    for step in range(args.steps):
        idx = torch.arange(step * 16, (step + 1) * 16) % 64
        x = counts[idx].float()
        if args.normalize:
            x = (x / 65535.0 - 0.5) / 0.29
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=not args.fp32):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), labels[idx])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
