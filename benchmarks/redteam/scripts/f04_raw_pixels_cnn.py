"""Microscopy classifier on 16-bit TIFF frames with fp16 autocast: loss nan at step 0.

Reported pattern: images are read as uint16 (0..65535 sensor counts) and converted with
.float() but never scaled to [0, 1] or standardised. The first convolution's fp16 output
exceeds 65504 (dividing by 65535, or mean/std normalisation, fixes it).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def load_batch(n):
    # synthetic 16-bit frames: background ~4000 counts, bright cells up to ~40000
    base = torch.full((n, 3, 32, 32), 4000.0) + 500 * torch.randn(n, 3, 32, 32)
    yy, xx = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    labels = torch.randint(0, 3, (n,))
    for i in range(n):
        cy, cx = torch.randint(8, 24, (2,))
        blob = torch.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2.0 * (3 + 2 * labels[i]) ** 2))
        base[i] += 56000 * blob
    frames = base.clamp(0, 60000).to(torch.int32)  # what tifffile gives back, as uint16 counts
    return frames, labels


class CellNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 5, padding=2)
        self.bn1 = nn.BatchNorm2d(64)
        self.conv2 = nn.Conv2d(64, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--normalize", action="store_true")
    args = p.parse_args()
    model = CellNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        frames, y = load_batch(16)
        x = frames.float()
        if args.normalize:
            x = x / 65535.0
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
