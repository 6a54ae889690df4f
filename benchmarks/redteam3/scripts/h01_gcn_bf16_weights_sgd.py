"""Two-layer GCN node classifier (citation-style synthetic graph), trained with the whole model
cast to bfloat16 (model.to(torch.bfloat16)) to halve memory, SGD with lr 0.001.

    python h01_gcn_bf16_weights_sgd.py [--fp32] [--steps N] [--lr LR]
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--lr", type=float, default=0.001)
a = ap.parse_args()
torch.manual_seed(0)
N, F_IN, HID, C = 600, 32, 64, 4
labels = torch.randint(0, C, (N,))
same = labels[:, None] == labels[None, :]
adj = (torch.rand(N, N) < torch.where(same, 0.03, 0.005)).float()
adj = ((adj + adj.T) > 0).float() + torch.eye(N)
dinv = adj.sum(1).rsqrt()
adj = dinv[:, None] * adj * dinv[None, :]
x = torch.randn(N, F_IN) + 0.3 * F.one_hot(labels, C).float().repeat(1, F_IN // C)
train = torch.rand(N) < 0.6


class GCN(nn.Module):
    def __init__(s):
        super().__init__()
        s.l1, s.l2 = nn.Linear(F_IN, HID), nn.Linear(HID, C)
        s.ln = nn.LayerNorm(HID)

    def forward(s, x, adj):
        h = torch.relu(s.ln(adj @ s.l1(x)))
        return adj @ s.l2(h)


model = GCN()
dt = torch.float32 if a.fp32 else torch.bfloat16
model.to(dt)
opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
for step in range(a.steps):
    out = model(x.to(dt), adj.to(dt))
    loss = F.cross_entropy(out[train].float(), labels[train])
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
