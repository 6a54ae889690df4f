"""Pure-fp16 CNN regressor (model.half(), plain SGD) with a learning rate 100x too high.

Reported pattern: "training in half precision to save memory"; the learning rate was copied
from a run that normalised its targets. Each SGD update overshoots and multiplies the error,
the final layer's weights grow several-fold per step and, a few steps in, the update itself
pushes them past float16's max (nothing skips a bad step: there is no GradScaler).
--lr 0.001 trains.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class AgeRegressor(nn.Module):
    """Predicts a scalar (age in years) from a 1x24x24 crop with a frozen feature extractor."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.norm = nn.LayerNorm(32, elementwise_affine=False)
        self.regressor = nn.Linear(32, 1)

    def forward(self, x):
        return self.regressor(self.norm(self.features(x)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()
    model = AgeRegressor().half()
    model.features.requires_grad_(False)  # pretrained backbone, frozen
    opt = torch.optim.SGD(model.regressor.parameters(), lr=args.lr)
    imgs = torch.rand(512, 1, 24, 24)
    ages = 20 + 50 * imgs.mean((1, 2, 3)) + 5 * torch.randn(512)  # years, not normalised
    for step in range(args.steps):
        idx = torch.arange(step * 32, (step + 1) * 32) % 512
        x, y = imgs[idx].half(), ages[idx]
        opt.zero_grad()
        pred = model(x).squeeze(1)
        loss = F.mse_loss(pred.float(), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
