"""Gated-graph-style GNN with one shared message-passing step applied for 30 rounds
(h <- tanh(W_self h + W_msg A h + b), sum over neighbours) on random 40-node graphs, graph-level regression.
fp16 autocast + GradScaler on CPU, Adam. The shared weights are
orthogonal with gain 1.5 so that information survives the 30 rounds.

    python d02_ggnn_shared_rounds_bf16_sgd.py [--fp32] [--clip C] [--gain G] [--steps N] [--lr LR]
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--clip", type=float, default=0.0)
ap.add_argument("--gain", type=float, default=1.5)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--lr", type=float, default=1e-3)
a = ap.parse_args()
torch.manual_seed(0)
N, D, R, B = 40, 32, 30, 16


class Propagate(nn.Module):
    def __init__(s):
        super().__init__()
        s.self_lin, s.msg_lin = nn.Linear(D, D), nn.Linear(D, D, bias=False)
        nn.init.orthogonal_(s.self_lin.weight, gain=a.gain)
        nn.init.orthogonal_(s.msg_lin.weight, gain=a.gain)

    def forward(s, h, adj):
        return torch.tanh(s.self_lin(h) + s.msg_lin(adj @ h))


class GGNN(nn.Module):
    def __init__(s):
        super().__init__()
        s.inp = nn.Linear(4, D)
        s.prop = Propagate()
        s.readout = nn.Linear(D, 1)

    def forward(s, x, adj):
        h = s.inp(x)
        for _ in range(R):
            h = s.prop(h, adj)
        return s.readout(h.mean(1)).squeeze(-1)


model = GGNN()
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    adj = (torch.rand(B, N, N, generator=g) < 0.1).float()
    adj = ((adj + adj.transpose(1, 2)) > 0).float()
    x = torch.randn(B, N, 4, generator=g)
    y = x[..., 0].mean(1) * 3
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        loss = F.mse_loss(model(x, adj).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    if a.clip:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
