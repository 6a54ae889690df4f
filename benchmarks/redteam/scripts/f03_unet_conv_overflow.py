"""Tiny DDPM UNet fine-tuned with fp16 autocast + GradScaler: loss nan, every step skipped.

Reported pattern (cf. the SDXL-VAE fp16 NaN reports): a checkpoint trained in fp32 has very large
internal activations in one up-sampling ResBlock; in fp16 that block's second convolution
exceeds 65504. The forward is already inf, so GradScaler can only keep skipping.
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, c_in, c_out, t_dim):
        super().__init__()
        self.norm1 = nn.GroupNorm(8, c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.temb = nn.Linear(t_dim, c_out)
        self.norm2 = nn.GroupNorm(8, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(temb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class TinyUNet(nn.Module):
    def __init__(self, ch=32, t_dim=64):
        super().__init__()
        self.t_dim = t_dim
        self.time_mlp = nn.Sequential(nn.Linear(t_dim, t_dim), nn.SiLU(), nn.Linear(t_dim, t_dim))
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        self.down = nn.ModuleList([ResBlock(ch, ch, t_dim), ResBlock(ch, 2 * ch, t_dim)])
        self.mid = ResBlock(2 * ch, 2 * ch, t_dim)
        self.up = nn.ModuleList([ResBlock(4 * ch, ch, t_dim), ResBlock(2 * ch, ch, t_dim)])
        self.norm_out = nn.GroupNorm(8, ch)
        self.conv_out = nn.Conv2d(ch, 3, 3, padding=1)

    def forward(self, x, t):
        temb = self.time_mlp(timestep_embedding(t, self.t_dim))
        h = self.conv_in(x)
        h0 = self.down[0](h, temb)
        h1 = self.down[1](F.avg_pool2d(h0, 2), temb)
        m = self.mid(h1, temb)
        u = self.up[0](torch.cat([m, h1], 1), temb)
        u = F.interpolate(u, scale_factor=2.0)
        u = self.up[1](torch.cat([u, h0], 1), temb)
        return self.conv_out(F.silu(self.norm_out(u)))


def load_pretrained(model):
    # stand-in for the fp32-trained checkpoint: the last up block's conv2 works at a large scale
    with torch.no_grad():
        model.up[1].conv2.weight.mul_(6e4)
        model.up[1].conv2.bias.mul_(6e4)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    args = p.parse_args()
    model = TinyUNet()
    load_pretrained(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    amp = args.precision == "fp16"
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    betas = torch.linspace(1e-4, 0.02, 1000)
    alpha_bar = torch.cumprod(1 - betas, 0)
    data = torch.rand(64, 3, 16, 16) * 2 - 1
    for step in range(args.steps):
        x0 = data[torch.randint(0, 64, (8,))]
        t = torch.randint(0, 1000, (8,))
        noise = torch.randn_like(x0)
        ab = alpha_bar[t][:, None, None, None]
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            loss = F.mse_loss(model(xt, t), noise)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
