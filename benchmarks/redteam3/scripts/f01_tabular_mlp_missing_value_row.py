"""Credit-risk MLP on a tabular export (12 standardised numeric columns), fp16 autocast +
GradScaler on CPU. The export writes missing values as NaN; the loader does not impute.

    python f01_tabular_mlp_missing_value_row.py [--fp32] [--impute] [--steps N]
--impute replaces NaN with the column mean (0 after standardisation).
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--impute", action="store_true")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--lr", type=float, default=3e-3)
a = ap.parse_args()
torch.manual_seed(0)
N, D, B = 2048, 12, 64
X = torch.randn(N, D)
y = ((X[:, 0] - X[:, 3] + 0.5 * X[:, 7]) > 0).long()
X[7 * B + 13, 5] = float("nan")  # one applicant with a missing income field
if a.impute:
    X = torch.nan_to_num(X, nan=0.0)
model = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)
for step in range(a.steps):
    i = torch.arange(step * B, step * B + B) % N
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        loss = F.cross_entropy(model(X[i]).float(), y[i])
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
