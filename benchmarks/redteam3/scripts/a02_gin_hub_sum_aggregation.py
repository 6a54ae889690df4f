"""Three-layer GIN node classifier on a synthetic social graph with a few celebrity hubs,
fp16 autocast + GradScaler on CPU. Neighbour features are summed with a dense adjacency
matmul (adj @ h), as in the GIN paper (sum aggregation is the most expressive).

    python a02_gin_hub_sum_aggregation.py [--fp32] [--mean] [--steps N] [--lr LR]
--mean uses mean aggregation (adj row-normalised) instead of the sum.
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--mean", action="store_true")
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--lr", type=float, default=1e-2)
a = ap.parse_args()
torch.manual_seed(0)
N, F_IN, HID, C = 1500, 16, 64, 4

# graph: random sparse edges + 5 hubs followed by (almost) everyone
adj = (torch.rand(N, N) < 0.002).float()
adj[:5, :] = (torch.rand(5, N) < 0.9).float()
adj = ((adj + adj.T) > 0).float()
adj.fill_diagonal_(0)
if a.mean:
    adj = adj / adj.sum(1, keepdim=True).clamp(min=1)
labels = torch.randint(0, C, (N,))
x = torch.randn(N, F_IN) + F.one_hot(labels, C).float().repeat(1, F_IN // C)
train = torch.rand(N) < 0.5


class GINLayer(nn.Module):
    def __init__(s, i, o):
        super().__init__()
        s.mlp = nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Linear(o, o), nn.ReLU())

    def forward(s, h, adj):
        return s.mlp(h + adj @ h)


class GIN(nn.Module):
    def __init__(s):
        super().__init__()
        s.convs = nn.ModuleList([GINLayer(F_IN, HID), GINLayer(HID, HID), GINLayer(HID, HID)])
        s.out = nn.Linear(HID, C)

    def forward(s, h, adj):
        for c in s.convs:
            h = c(h, adj)
        return s.out(h)


model = GIN()
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)
for step in range(a.steps):
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        out = model(x, adj)
        loss = F.cross_entropy(out[train].float(), labels[train])
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
