"""Precision loss without NaN: a small CNN whose `features.2` layer computes (h + c) - c.

The same cancellation as shift_mlp.py in another architecture: a conv block's "shift" layer
adds a large per-channel offset buffer (2048) and takes it away again, under
torch.autocast("cpu", float16) + GradScaler. Float16's spacing near 2048 is 2.0, so the layer's
output keeps almost nothing of h. Nothing is non-finite; `nanhunt audit` should rank
`features.2` first and advise float32 for it.
Modules: "" (CNN), "features" (Sequential), "features.0" (Conv2d), "features.1" (ReLU),
"features.2" (Shift), "features.3" (Conv2d), "features.4" (ReLU), "pool", "head".
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Shift(nn.Module):
    def __init__(self, channels, offset=2048.0):
        super().__init__()
        self.register_buffer("offset", torch.full((1, channels, 1, 1), offset))

    def forward(self, h):
        return (h + self.offset.to(h.dtype)) - self.offset.to(h.dtype)


class CNN(nn.Module):
    def __init__(self, n_classes=3):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), Shift(8),
            nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, n_classes)

    def forward(self, x):
        return self.head(self.pool(self.features(x)).flatten(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    x_all = torch.randn(64, 3, 8, 8) * 3
    y_all = torch.randint(0, 3, (64,))
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        idx = torch.arange(step * 16, (step + 1) * 16) % 64
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
