"""Tiny UNet for monocular depth estimation on synthetic 16x16 scenes, fp16 autocast +
GradScaler on CPU. Depth is predicted with a ReLU head (depth >= 0) and trained with the
scale-invariant log loss of Eigen et al. (2014): d = log(pred + 1e-8) - log(gt),
loss = mean(d^2) - 0.5 * mean(d)^2.

    python b03_unet_depth_silog_loss.py [--fp32] [--fixed] [--steps N] [--lr LR]
--fixed takes the log in float32: log(pred.float() + 1e-8).
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--fixed", action="store_true")
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--lr", type=float, default=2e-3)
a = ap.parse_args()
torch.manual_seed(0)
B, S = 16, 16


class UNet(nn.Module):
    def __init__(s, c=8):
        super().__init__()
        s.enc = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        s.down = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU())
        s.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        s.head = nn.Sequential(nn.Conv2d(2 * c, 1, 3, padding=1), nn.ReLU())

    def forward(s, x):
        h = s.enc(x)
        return s.head(torch.cat([h, s.up(s.down(h))], 1))


def silog(pred, gt):
    d = torch.log(pred.float() + 1e-8) if a.fixed else torch.log(pred + 1e-8)
    d = d - torch.log(gt)
    return (d ** 2).mean() - 0.5 * d.mean() ** 2


model = UNet()
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)
g = torch.Generator().manual_seed(1)
yy = torch.linspace(0, 1, S).view(1, 1, S, 1).expand(B, 1, S, S)
for step in range(a.steps):
    tilt = torch.rand(B, 1, 1, 1, generator=g) * 4 + 1
    gt = 1 + tilt * yy + 0.05 * torch.rand(B, 1, S, S, generator=g)        # metres
    img = torch.cat([gt / 5, (gt / 5) ** 2, torch.randn(B, 1, S, S, generator=g) * 0.1], 1)
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        pred = model(img)
        loss = silog(pred, gt)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
