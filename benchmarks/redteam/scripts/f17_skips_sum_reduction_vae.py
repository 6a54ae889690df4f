"""Conv VAE on 28x28 images with reduction="sum" losses (as in the PyTorch VAE example),
fp16 autocast + GradScaler with the default init_scale.

Reported pattern: the example's loss, BCE(reduction="sum") + KL summed over the batch, is
~2e4. Multiplied by GradScaler's 2^16 the decoder's weight gradients (sums over every pixel of
the batch) overflow float16, so GradScaler skips step after step while it halves the scale
down to a few hundred: more than half of this short run's steps are lost. (Mean reduction, or
init_scale ~2^8, avoids it.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class ConvVAE(nn.Module):
    def __init__(self, z=16):
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv2d(1, 32, 4, 2, 1), nn.ReLU(), nn.Conv2d(32, 64, 4, 2, 1), nn.ReLU(),
            nn.Flatten())
        self.mu = nn.Linear(64 * 7 * 7, z)
        self.logvar = nn.Linear(64 * 7 * 7, z)
        self.dec_in = nn.Linear(z, 64 * 7 * 7)
        self.dec = nn.Sequential(
            nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(32, 1, 4, 2, 1))

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(self.dec_in(z).view(-1, 64, 7, 7)), mu, logvar


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    model = ConvVAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    data = (torch.rand(512, 1, 28, 28) < 0.3).float()
    for step in range(args.steps):
        x = data[step * 16 % 512:][:16]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits, mu, logvar = model(x)
        bce = F.binary_cross_entropy_with_logits(logits.float(), x, reduction="sum")
        kld = -0.5 * torch.sum(1 + logvar.float() - mu.float() ** 2 - logvar.float().exp())
        loss = bce + kld
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.1f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
