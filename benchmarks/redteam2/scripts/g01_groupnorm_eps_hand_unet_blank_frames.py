"""Small UNet denoiser with a hand-written GroupNorm (eps=1e-12 copied from a BERT config),
fp16 autocast + GradScaler; the dataset contains blank (all-zero) frames.

The convolutions before each norm have no bias (the norm has its own affine), so an all-zero
input frame gives all-zero feature maps and every group has variance exactly 0. The norm's
statistics are computed on the fp16 conv output, and 0 + 1e-12 rounds to 0 in fp16:
(x - mean) / sqrt(0) = 0 / 0 = NaN in the first norm's forward. In float32 1e-12 is enough
(--precision fp32 trains).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class GroupNorm(nn.Module):
    def __init__(self, groups, channels, eps=1e-12):
        super().__init__()
        self.g, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        b, c, h, w = x.shape
        xg = x.view(b, self.g, -1)
        mean = xg.mean(-1, keepdim=True)
        var = ((xg - mean) ** 2).mean(-1, keepdim=True)
        xg = (xg - mean) / torch.sqrt(var + self.eps)
        return xg.view(b, c, h, w) * self.weight[:, None, None] + self.bias[:, None, None]


def block(ci, co):
    return nn.Sequential(nn.Conv2d(ci, co, 3, padding=1, bias=False), GroupNorm(4, co), nn.SiLU(),
                         nn.Conv2d(co, co, 3, padding=1, bias=False), GroupNorm(4, co), nn.SiLU())


class UNet(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.d1, self.d2 = block(1, c), block(c, 2 * c)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.u1 = block(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        h1 = self.d1(x)
        h2 = self.d2(F.avg_pool2d(h1, 2))
        return self.out(self.u1(torch.cat([self.up(h2), h1], 1)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    frames = torch.rand(64, 1, 16, 16).cumsum(-1).div(16)
    frames[::8] = 0.0                                  # blank frames (camera off)
    model = UNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    for step in range(a.steps):
        x = frames[(step % 4) * 16:(step % 4 + 1) * 16]
        noisy = x + 0.1 * torch.randn_like(x) * (x.flatten(1).amax(1) > 0)[:, None, None, None]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            pred = model(noisy)
        loss = F.mse_loss(pred.float(), x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.5f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
