"""Fails: a conv in a VAE-style decoder overflows fp16, and its float32 output exceeds 65504 too.

Latent diffusion style: a frozen "encoder" makes latents, which are multiplied by the VAE's
scaling factor (0.18215) before the "decoder". From step 2 the latents are divided by the
factor instead (the classic mix-up), 30x larger. Conv2d "decoder.up.1" (after an upsample) then
outputs values above 65504: fp16 +/-inf at step 2, forward. Its float32 output is above 65504 as
well, so running that conv alone in float32 and casting back gives inf again; the float32
region must run on through "decoder.norm" (GroupNorm), where values are back in range.
Autocast fp16 + GradScaler; only the decoder trains (reconstruction MSE).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

SCALING_FACTOR = 0.18215


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 4, stride=2, padding=1)

    def forward(self, x):
        return self.conv(x)


class Decoder(nn.Module):
    def __init__(self, ch=32):
        super().__init__()
        self.conv_in = nn.Conv2d(4, ch, 3, padding=1)
        self.up = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(ch, ch, 3, padding=1))
        self.norm = nn.GroupNorm(8, ch)
        self.act = nn.SiLU()
        self.conv_out = nn.Conv2d(ch, 3, 3, padding=1)

    def forward(self, z):
        return self.conv_out(self.act(self.norm(self.up(self.conv_in(z)))))


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = Decoder()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    vae = VAE()
    vae.encoder.requires_grad_(False)
    with torch.no_grad():  # a decoder initialised far too large (a bad checkpoint conversion)
        vae.decoder.conv_in.weight.mul_(GAIN)
        vae.decoder.up[1].weight.mul_(3 * GAIN)
    optimizer = torch.optim.Adam(vae.decoder.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    images = torch.randn(64, 3, 16, 16) * 40.0
    for step in range(args.steps):
        x = images[(step * 8) % 64:(step * 8) % 64 + 8]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            z = vae.encoder(x)
            z = z / SCALING_FACTOR if step >= 2 else z * SCALING_FACTOR  # the mix-up
            recon = vae.decoder(z)
            recon = F.interpolate(recon, size=x.shape[-2:])
        loss = F.mse_loss(recon.float(), x / 40.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


GAIN = 12.0

if __name__ == "__main__":
    main()
