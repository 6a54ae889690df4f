"""Small GPT (2 layers, d=64) on a synthetic next-token task, the whole model in bfloat16
(model.to(torch.bfloat16)) to save memory, SGD with momentum and lr 0.001.

    python h02_gpt_bf16_weights_sgd.py [--fp32] [--steps N] [--lr LR]
"""
import argparse, math
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--lr", type=float, default=0.001)
a = ap.parse_args()
torch.manual_seed(0)
V, D, T, B, L = 32, 64, 32, 16, 2


class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.ln1, s.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        s.qkv, s.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        s.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(s, x):
        q, k, v = s.qkv(s.ln1(x)).split(D, -1)
        att = (q @ k.transpose(1, 2)) / math.sqrt(D)
        att = att.masked_fill(~torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril(), float("-inf"))
        x = x + s.proj(att.softmax(-1) @ v)
        return x + s.mlp(s.ln2(x))


class GPT(nn.Module):
    def __init__(s):
        super().__init__()
        s.tok, s.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        s.blocks = nn.Sequential(*[Block() for _ in range(L)])
        s.ln_f, s.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(s, idx):
        return s.head(s.ln_f(s.blocks(s.tok(idx) + s.pos(torch.arange(idx.shape[1])))))


model = GPT()
if not a.fp32:
    model.to(torch.bfloat16)
opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    start = torch.randint(0, V, (B, 1), generator=g)
    seq = (start + torch.arange(T + 1) * 3) % V
    loss = F.cross_entropy(model(seq[:, :-1]).float().reshape(-1, V), seq[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
