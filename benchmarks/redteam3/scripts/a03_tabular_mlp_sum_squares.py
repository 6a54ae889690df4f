"""Multi-target tabular regression MLP (32 standardised targets), fp16 autocast + GradScaler on
CPU, large batches. The loss is written out by hand as the mean squared error:
((pred - y) ** 2).sum() / pred.numel().

    python a03_tabular_mlp_sum_squares.py [--fp32] [--fixed] [--steps N] [--lr LR]
--fixed uses F.mse_loss(pred.float(), y).
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--fixed", action="store_true")
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--lr", type=float, default=1e-3)
a = ap.parse_args()
torch.manual_seed(0)
N, D, K, B = 16384, 32, 32, 4096
X = torch.randn(N, D)
W = torch.randn(D, K) / D ** 0.5
Y = torch.tanh(X @ W) * 1.5 + 0.1 * torch.randn(N, K)
Y = (Y - Y.mean(0)) / Y.std(0)
X, Y = X.half(), Y.half()  # keep the table in half precision to save memory

model = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, K))
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    i = torch.randint(0, N, (B,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        xb, yb = (X[i], Y[i]) if not a.fp32 else (X[i].float(), Y[i].float())
        pred = model(xb)
        if a.fixed:
            loss = F.mse_loss(pred.float(), Y[i].float())
        else:
            loss = ((pred - yb) ** 2).sum() / pred.numel()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
