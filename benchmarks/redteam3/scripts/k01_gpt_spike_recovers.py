"""Small GPT (2 layers, d=64) on a synthetic next-token task, fp16 autocast + GradScaler on CPU,
AdamW lr 3e-3. At step 12 the loader serves one batch from a different source (random tokens);
the loss jumps for that batch and training carries on.

    python k01_gpt_spike_recovers.py [--fp32] [--steps N] [--lr LR]
"""
import argparse, math
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--lr", type=float, default=3e-3)
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
opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    start = torch.randint(0, V, (B, 1), generator=g)
    seq = (start + torch.arange(T + 1) * 3) % V
    if step == 12:
        seq = torch.randint(0, V, (B, T + 1), generator=g)
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        loss = F.cross_entropy(model(seq[:, :-1]).float().reshape(-1, V), seq[:, 1:].reshape(-1))
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
