"""Denoising CNN trained in pure fp16 (model.half()) with torch.optim.Adam defaults.

Reported pattern: the loss prints fine for step 0, then nan. Adam's eps=1e-8 is 0 in float16
and the second-moment update (1 - beta2) * g^2 flushes to zero for the many small gradients,
so the first update divides by zero and writes inf/nan into the weights.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class DnCNN(nn.Module):
    def __init__(self, ch=32, depth=4):
        super().__init__()
        layers = [nn.Conv2d(1, ch, 3, padding=1), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU()]
        layers += [nn.Conv2d(ch, 1, 3, padding=1)]
        self.body = nn.Sequential(*layers)

    def forward(self, noisy):
        return noisy - self.body(noisy)  # residual learning: predict the noise


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    model = DnCNN().half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    clean = torch.rand(64, 1, 24, 24).cumsum(-1) / 24
    for step in range(args.steps):
        x = clean[step * 8 % 64:][:8]
        noisy = x + 0.1 * torch.randn_like(x)
        opt.zero_grad()
        out = model(noisy.half())
        loss = F.mse_loss(out.float(), x)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.5f}")


if __name__ == "__main__":
    main()
