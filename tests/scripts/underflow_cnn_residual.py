"""Fails silently: a CNN denoiser predicts the sensor-noise residual in raw sensor units; without a
GradScaler its fp16 output gradients flush to zero and the model never learns.

Autocast fp16, fp32 parameters, no GradScaler (``--scaler``: healthy control; ``--fp32``: float32
reference).  The residual (target) has std ~5e-5 in raw units and the last conv is initialised
small, so the error is ~5e-5 and d(mse)/d(output) = 2 * error / (16 * 1 * 16 * 16) ~ 2.4e-8 in
float32: cast to fp16 at the output of "decoder.2" (the last conv, fp16 under autocast) most of
it is below fp16's smallest subnormal (5.96e-8) and becomes exactly 0; the rest is subnormal.
Expected: no non-finite value; every step, phase backward, module "decoder.2" (first in backward
order) with most of its grad_output[0] flushed to zero.  Fix: GradScaler or rescaled targets.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Denoiser(nn.Module):
    def __init__(self, ch=16):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(1, ch, 3, padding=1), nn.ReLU(),
                                     nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU())
        self.decoder = nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU(),
                                     nn.Conv2d(ch, 1, 3, padding=1))
        with torch.no_grad():
            self.decoder[2].weight.mul_(1e-4)
            self.decoder[2].bias.zero_()

    def forward(self, x):
        return self.decoder(self.encoder(x))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--scaler", action="store_true")
    parser.add_argument("--fp32", action="store_true")
    args = parser.parse_args()

    model = Denoiser()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if args.scaler else None
    for step in range(args.steps):
        clean = torch.rand(16, 1, 16, 16)  # small: float16 convolutions are slow on CPU
        noise = 5e-5 * torch.randn_like(clean)  # raw sensor units
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=not args.fp32):
            loss = F.mse_loss(model(clean + noise), noise)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        print(f"step {step} loss {loss.item():.4e}")


if __name__ == "__main__":
    main()
