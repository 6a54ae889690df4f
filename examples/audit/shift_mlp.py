"""Precision loss without NaN: an MLP whose `recenter` layer computes (x + c) - c in float16.

Trains finitely under torch.autocast("cpu", float16) + GradScaler. `recenter` adds a large
offset (c = 1024) and takes it away again: in float16 the spacing of values near 1024 is 1.0, so
its output keeps only the integer part of x (catastrophic cancellation). Nothing is ever
non-finite; `nanhunt audit` should rank `recenter` first and advise float32 for it.
Modules: "" (MLP), "fc1", "act", "recenter" (Recenter), "fc2", "act2", "drop", "head".
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Recenter(nn.Module):
    def __init__(self, offset=1024.0):
        super().__init__()
        self.offset = offset

    def forward(self, x):
        return (x + self.offset) - self.offset


class MLP(nn.Module):
    def __init__(self, d_in=16, d=32, n_classes=4):
        super().__init__()
        self.fc1, self.act = nn.Linear(d_in, d), nn.GELU()
        self.recenter = Recenter()
        self.fc2, self.act2 = nn.Linear(d, d), nn.GELU()
        self.drop = nn.Dropout(0.1)  # random numbers the audit must replay and leave alone
        self.head = nn.Linear(d, n_classes)

    def forward(self, x):
        return self.head(self.drop(self.act2(self.fc2(self.recenter(self.act(self.fc1(x)))))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    x_all = torch.randn(256, 16)
    y_all = (x_all[:, 0] > 0).long() + 2 * (x_all[:, 1] > 0).long()
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        idx = torch.arange(step * 32, (step + 1) * 32) % 256
        x, y = x_all[idx], y_all[idx]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
