"""Small CNN classifier (8x8 synthetic images, 10 classes), bf16 autocast on CPU, SGD with
momentum 0.9 and lr 1.0 (copied from a large-batch recipe).

    python e02_cnn_sgd_lr_high_bf16.py [--fp32] [--lr LR] [--clip C] [--steps N]
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--lr", type=float, default=1.0)
ap.add_argument("--clip", type=float, default=0.0)
ap.add_argument("--steps", type=int, default=25)
a = ap.parse_args()
torch.manual_seed(0)
C, B = 10, 32
protos = torch.randn(C, 3, 8, 8)
model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(32 * 4, 64), nn.ReLU(), nn.Linear(64, C))
opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    y = torch.randint(0, C, (B,), generator=g)
    x = protos[y] + 0.5 * torch.randn(B, 3, 8, 8, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not a.fp32):
        loss = F.cross_entropy(model(x).float(), y)
    opt.zero_grad()
    loss.backward()
    if a.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
