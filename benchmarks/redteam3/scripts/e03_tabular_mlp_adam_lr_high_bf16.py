"""Tabular MLP classifier (3 classes, 20 standardised features), bf16 autocast on CPU,
AdamW with lr 0.3.

    python e03_tabular_mlp_adam_lr_high_bf16.py [--fp32] [--lr LR] [--clip C] [--steps N]
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--lr", type=float, default=0.3)
ap.add_argument("--clip", type=float, default=0.0)
ap.add_argument("--steps", type=int, default=40)
a = ap.parse_args()
torch.manual_seed(0)
D, C, B = 20, 3, 256
X = torch.randn(4096, D)
Y = (X[:, :3] + 0.3 * X[:, 3:6]).argmax(1)
model = nn.Sequential(nn.Linear(D, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, C))
opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    i = torch.randint(0, 4096, (B,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not a.fp32):
        loss = F.cross_entropy(model(X[i]).float(), Y[i])
    opt.zero_grad()
    loss.backward()
    if a.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
