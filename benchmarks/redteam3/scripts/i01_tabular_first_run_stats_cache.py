"""Insurance-claims MLP (8 numeric columns), fp16 autocast + GradScaler on CPU. Feature
statistics for standardisation are cached in a JSON file (path from $FEATURE_STATS_CACHE,
default ./feature_stats.json). When the cache is missing, the script computes the statistics
from the first shard it reads and writes the full-data statistics to the cache at the end.

    python i01_tabular_first_run_stats_cache.py [--fp32] [--steps N]
"""
import argparse, json, os
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--steps", type=int, default=15)
ap.add_argument("--lr", type=float, default=3e-3)
a = ap.parse_args()
torch.manual_seed(0)
N, D, B = 2048, 8, 64
X = torch.randn(N, D) * torch.tensor([1, 2, 5, 1, 3, 1, 1, 10.0]) + 3
X[:256, 6] = 1.0  # the first shard comes from a region where the 'discount' column is constant
y = ((X[:, 0] - X[:, 2] / 5 + X[:, 6]) > 3).long()
cache = os.environ.get("FEATURE_STATS_CACHE", "feature_stats.json")
if os.path.exists(cache):
    st = json.load(open(cache))
    mean, std = torch.tensor(st["mean"]), torch.tensor(st["std"])
else:
    shard = X[:256]
    mean, std = shard.mean(0), shard.std(0)
Xn = (X - mean) / std
model = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, 2))
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    i = torch.randint(0, N, (B,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        loss = F.cross_entropy(model(Xn[i]).float(), y[i])
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
if not os.path.exists(cache):
    json.dump({"mean": X.mean(0).tolist(), "std": X.std(0).tolist()}, open(cache, "w"))
