"""Two-layer GIN graph classifier (mean-normalised aggregation) on random graphs, fp16 autocast
on CPU with GradScaler(init_scale=2**24): the first steps are skipped while the scale backs off
to a value that fits, then training proceeds.

    python k04_gin_calibration_skips.py [--fp32] [--steps N] [--lr LR]
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--lr", type=float, default=3e-3)
a = ap.parse_args()
torch.manual_seed(0)
N, D, B = 20, 16, 32


class GIN(nn.Module):
    def __init__(s):
        super().__init__()
        s.mlp1 = nn.Sequential(nn.Linear(4, D), nn.ReLU(), nn.Linear(D, D))
        s.mlp2 = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
        s.out = nn.Linear(D, 2)

    def forward(s, x, adj):
        h = torch.relu(s.mlp1(x + adj @ x))
        h = torch.relu(s.mlp2(h + adj @ h))
        return s.out(h.mean(1))


model = GIN()
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, enabled=not a.fp32)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    y = torch.randint(0, 2, (B,), generator=g)
    p = 0.1 + 0.2 * y.float()
    adj = (torch.rand(B, N, N, generator=g) < p[:, None, None]).float()
    adj = ((adj + adj.transpose(1, 2)) > 0).float()
    adj = adj / adj.sum(-1, keepdim=True).clamp(min=1)
    x = torch.randn(B, N, 4, generator=g)
    x[..., 0] = adj.sum(-1) * 0 + (adj > 0).float().sum(-1) / N
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        loss = F.cross_entropy(model(x, adj).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale() if scaler.is_enabled() else 1:.0f}", flush=True)
