"""Small transformer encoder for sentence classification over variable-length token sequences,
fp16 autocast + GradScaler on CPU. Padding is handled with a key-padding mask filled with -inf
before the softmax (hand-written attention). The data loader pads every batch to a fixed length;
the corpus contains some empty documents (length 0).

    python b01_transformer_padded_batch_classifier.py [--fp32] [--fixed] [--steps N]
--fixed drops empty documents in the data loader.
"""
import argparse, math
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--fixed", action="store_true")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--lr", type=float, default=1e-3)
a = ap.parse_args()
torch.manual_seed(0)
V, D, T, B, C = 100, 64, 24, 16, 2

g = torch.Generator().manual_seed(1)
N = 640
lengths = torch.randint(3, T + 1, (N,), generator=g)
lengths[torch.tensor([200, 341, 517])] = 0  # a few empty documents in the corpus
tokens = torch.randint(1, V, (N, T), generator=g)
labels = (tokens[:, 0] % 2)
if a.fixed:
    keep = lengths > 0
    tokens, labels, lengths = tokens[keep], labels[keep], lengths[keep]


class SelfAttention(nn.Module):
    def __init__(s):
        super().__init__()
        s.qkv, s.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(s, x, pad):
        q, k, v = s.qkv(x).chunk(3, -1)
        att = q @ k.transpose(1, 2) / math.sqrt(D)
        att = att.masked_fill(pad[:, None, :], float("-inf"))
        return s.out(att.softmax(-1) @ v)


class Encoder(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb, s.pos = nn.Embedding(V, D), nn.Parameter(torch.randn(T, D) * 0.02)
        s.attn, s.ln1, s.ln2 = SelfAttention(), nn.LayerNorm(D), nn.LayerNorm(D)
        s.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        s.cls = nn.Linear(D, C)

    def forward(s, tok, pad):
        x = s.emb(tok) + s.pos
        x = x + s.attn(s.ln1(x), pad)
        x = x + s.ff(s.ln2(x))
        keep = (~pad).unsqueeze(-1).float()
        return s.cls((x * keep).sum(1) / keep.sum(1).clamp(min=1))


model = Encoder()
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)
n = len(tokens)
for step in range(a.steps):
    i = torch.arange(step * B, step * B + B) % n
    pad = torch.arange(T)[None, :] >= lengths[i][:, None]
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        logits = model(tokens[i], pad)
        loss = F.cross_entropy(logits.float(), labels[i])
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
