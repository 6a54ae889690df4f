"""Conv autoencoder with fp16 autocast and no GradScaler: the loss never moves.

Reported pattern: the reconstruction weight lambda_rec = 1e-4 was tuned for a sum-reduced loss
in the original code; here the BCE is mean-reduced over 16x1x32x32 pixels, so the per-pixel
gradient lambda * (sigmoid(z) - x) / N is ~1e-9. It flushes to zero in the decoder's float16
output gradient, every weight gradient is zero and the model does not learn.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class ConvAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(1, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU())
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(16, 1, 4, stride=2, padding=1))

    def forward(self, x):
        return self.decoder(self.encoder(x))  # logits


def make_digits(n):
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, 32), torch.linspace(-1, 1, 32), indexing="ij")
    r = 0.3 + 0.4 * torch.rand(n, 1, 1)
    ring = (((yy ** 2 + xx ** 2).sqrt() - r).abs() < 0.08).float()
    return ring[:, None]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    p.add_argument("--lambda-rec", type=float, default=1e-4)
    args = p.parse_args()
    model = ConvAE()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    data = make_digits(256)
    for step in range(args.steps):
        x = data[step * 16 % 256:][:16]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=args.precision == "fp16"):
            logits = model(x)
        loss = args.lambda_rec * F.binary_cross_entropy_with_logits(logits.float(), x)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4e}")


if __name__ == "__main__":
    main()
