"""Tiny GPT on a synthetic copy task, fp16 autocast + GradScaler on CPU.

Embeddings are scaled by sqrt(d_model) as in "Attention is all you need"; the projections use
LeCun-normal init (std d^-0.5). Two wide heads (head_dim 512). Attention is written by hand:
scores = q @ k^T, then divided by sqrt(head_dim), causal mask, softmax.

    python a01_gpt_wide_head_attention.py [--fp32] [--fixed] [--steps N] [--lr LR]
--fixed divides q by sqrt(head_dim) before the matmul instead of after it.
"""
import argparse, math
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--fixed", action="store_true")
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--lr", type=float, default=3e-4)
a = ap.parse_args()
torch.manual_seed(0)
V, D, H, T, B = 64, 1024, 2, 32, 4


class Attn(nn.Module):
    def __init__(s):
        super().__init__()
        s.qkv = nn.Linear(D, 3 * D)
        s.proj = nn.Linear(D, D)
        nn.init.normal_(s.qkv.weight, std=D ** -0.5)
        nn.init.normal_(s.proj.weight, std=D ** -0.5)

    def forward(s, x):
        b, t, _ = x.shape
        q, k, v = s.qkv(x).split(D, -1)
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in (q, k, v))
        hd = D // H
        if a.fixed:
            att = (q / math.sqrt(hd)) @ k.transpose(-2, -1)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, D)
        return s.proj(y)


class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.attn = Attn()
        s.ln = nn.LayerNorm(D)
        s.mlp = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D))

    def forward(s, x):
        x = x + s.attn(x)
        return x + s.mlp(s.ln(x))


class GPT(nn.Module):
    def __init__(s):
        super().__init__()
        s.tok = nn.Embedding(V, D)
        s.pos = nn.Embedding(T, D)
        s.blocks = nn.ModuleList([Block()])
        s.ln_f = nn.LayerNorm(D)
        s.head = nn.Linear(D, V)

    def forward(s, idx):
        x = (s.tok(idx) + s.pos(torch.arange(idx.shape[1]))) * math.sqrt(D)
        for blk in s.blocks:
            x = blk(x)
        return s.head(s.ln_f(x))


model = GPT()
opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    half = torch.randint(0, V, (B, T // 2), generator=g)
    seq = torch.cat([half, half], 1)
    x, y = seq[:, :-1], seq[:, 1:]
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
