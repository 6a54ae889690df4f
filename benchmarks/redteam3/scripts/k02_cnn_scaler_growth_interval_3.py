"""Small CNN classifier (8x8 synthetic images), fp16 autocast on CPU with
GradScaler(init_scale=2**10, growth_interval=3): the scale grows every 3 clean steps and backs
off when a step overflows.

    python k02_cnn_scaler_growth_interval_3.py [--fp32] [--steps N] [--lr LR]
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--lr", type=float, default=5e-3)
a = ap.parse_args()
torch.manual_seed(0)
C, B = 10, 32
protos = torch.randn(C, 3, 8, 8)
model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(32 * 4, 64), nn.ReLU(), nn.Linear(64, C))
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3, enabled=not a.fp32)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    y = torch.randint(0, C, (B,), generator=g)
    x = protos[y] + 0.7 * torch.randn(B, 3, 8, 8, generator=g)
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        loss = F.cross_entropy(model(x).float(), y, reduction="sum")
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item() / B:.4f}", flush=True)
