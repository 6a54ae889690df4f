"""Tiny UNet denoiser on 8x8 blobs, fp16 autocast on CPU. The training step was refactored into
a function that builds its own torch.amp.GradScaler each call. The loss is the summed squared
error per image, averaged over the batch (as in the original paper's code).

    python g02_unet_scaler_inside_loop.py [--fp32] [--fixed] [--steps N] [--lr LR]
--fixed creates the GradScaler once, outside the training step.
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--fixed", action="store_true")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--lr", type=float, default=2e-3)
a = ap.parse_args()
torch.manual_seed(0)
B = 16


class UNet(nn.Module):
    def __init__(s, c=8):
        super().__init__()
        s.enc = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU())
        s.down = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU())
        s.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        s.out = nn.Conv2d(2 * c, 1, 3, padding=1)

    def forward(s, x):
        h = s.enc(x)
        return s.out(torch.cat([h, s.up(s.down(h))], 1))


model = UNet()
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
shared_scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)


def train_step(noisy, clean):
    scaler = shared_scaler if a.fixed else torch.amp.GradScaler("cpu", enabled=not a.fp32)
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        out = model(noisy)
        loss = F.mse_loss(out.float(), clean, reduction="sum") / noisy.shape[0]
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


g = torch.Generator().manual_seed(1)
yy, xx = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
for step in range(a.steps):
    c = torch.randint(1, 7, (B, 2), generator=g).float()
    clean = torch.exp(-((xx - c[:, 0, None, None]) ** 2 + (yy - c[:, 1, None, None]) ** 2) / 3)[:, None] * 4
    noisy = clean + 0.5 * torch.randn(B, 1, 8, 8, generator=g)
    loss = train_step(noisy, clean)
    print(f"step {step} loss {loss.item():.4f}", flush=True)
