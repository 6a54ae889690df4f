"""A 10-step fine-tune of a small UNet denoiser with GradScaler(init_scale=2**32), fp16 autocast.

The init_scale was copied from a large-model recipe (Megatron-style 2^32). GradScaler only halves
the scale once per overflowing step, so reaching a scale at which this model's gradients fit
fp16 takes ~18 skipped steps: in a 10-step fine-tune *every* step is skipped, the weights never
change and the run silently does nothing. The default init_scale (2^16) fine-tunes normally.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def block(ci, co):
    return nn.Sequential(nn.Conv2d(ci, co, 3, padding=1), nn.GroupNorm(8, co), nn.SiLU(),
                         nn.Conv2d(co, co, 3, padding=1), nn.GroupNorm(8, co), nn.SiLU())


class UNet(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.d1, self.d2 = block(1, c), block(c, 2 * c)
        self.mid = block(2 * c, 2 * c)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.u1 = block(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        h1 = self.d1(x)
        h2 = self.mid(self.d2(F.avg_pool2d(h1, 2)))
        return self.out(self.u1(torch.cat([self.up(h2), h1], 1)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--init-scale", type=float, default=2.0 ** 32)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    clean = torch.rand(64, 1, 16, 16).cumsum(-1).div(16)        # smooth synthetic images
    model = UNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=a.init_scale, enabled=fp16)
    for step in range(a.steps):
        x = clean[(step % 4) * 16:(step % 4 + 1) * 16]
        noise = torch.randn_like(x) * 0.2
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            pred = model(x + noise)
        loss = F.mse_loss(pred.float(), noise)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.5f} scale {scaler.get_scale():.3g}")


if __name__ == "__main__":
    main()
