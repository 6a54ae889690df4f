"""CIFAR-style CNN converted to AMP: a leftover optimizer.step() after scaler.step().

Reported pattern: "weights become nan at the first step although the loss is fine". The AMP
port added scaler.scale/step/update but kept the original `optimizer.step()` line. On a step
GradScaler skips (inf gradients at the initial scale 2^16) that extra call applies the inf
gradients anyway, and on the others it applies every update twice.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class SmallResNet(nn.Module):
    def __init__(self, n_cls=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32))
        self.fc = nn.Linear(32, n_cls)

    def forward(self, x):
        h = self.stem(x)
        h = F.relu(h + self.block(h))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    model = SmallResNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x = torch.randn(16, 3, 16, 16)
        y = torch.randint(0, 10, (16,))
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y, reduction="sum")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
