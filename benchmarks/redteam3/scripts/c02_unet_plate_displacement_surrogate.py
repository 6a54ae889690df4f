"""Small UNet surrogate for a finite-element solver: maps a 16x16 load map on a steel plate to
the vertical displacement field in metres (displacements ~1e-5 m). fp16 autocast on CPU, no
GradScaler (the loss never overflows). The output conv starts at zero; the learning rate is
small to match the target scale.

    python c02_unet_plate_displacement_surrogate.py [--fp32] [--scaler] [--steps N] [--lr LR]
--scaler adds torch.amp.GradScaler.
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--scaler", action="store_true")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--lr", type=float, default=3e-7)
a = ap.parse_args()
torch.manual_seed(0)
B, S = 16, 16


class UNet(nn.Module):
    def __init__(s, c=8):
        super().__init__()
        s.enc = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU())
        s.down = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU())
        s.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        s.out = nn.Conv2d(2 * c, 1, 3, padding=1)
        nn.init.zeros_(s.out.weight)
        nn.init.zeros_(s.out.bias)

    def forward(s, x):
        h = s.enc(x)
        return s.out(torch.cat([h, s.up(s.down(h))], 1))


kern = torch.exp(-torch.arange(-3.0, 4.0) ** 2 / 4)
kern = (kern[:, None] * kern[None, :])[None, None]
kern = kern / kern.sum()


def solver(load):  # smoothed load -> displacement in metres
    return 2e-5 * F.conv2d(F.conv2d(load, kern, padding=3), kern, padding=3)


model = UNet()
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=a.scaler and not a.fp32)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    load = (torch.rand(B, 1, S, S, generator=g) < 0.1).float()
    disp = solver(load)
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        pred = model(load)
        loss = F.mse_loss(pred.float(), disp)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4e}", flush=True)
