"""HEALTHY: decoder-only transformer with a -inf causal mask (nn.MultiheadAttention) and a
hand-written cross-attention whose padding mask uses torch.finfo(dtype).min, fp16 autocast +
GradScaler. Every -inf / finfo.min is absorbed by the softmax; no row is fully masked.
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class CrossAttention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, mem, mem_pad):
        s = self.q(x) @ self.k(mem).transpose(-2, -1) / math.sqrt(x.shape[-1])
        s = s.masked_fill(mem_pad[:, None, :], torch.finfo(s.dtype).min)
        return self.o(s.softmax(-1) @ self.v(mem))


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.cross = CrossAttention(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, causal, mem, mem_pad):
        a = self.ln1(x)
        x = x + self.self_attn(a, a, a, attn_mask=causal, need_weights=False)[0]
        x = x + self.cross(self.ln2(x), mem, mem_pad)
        return x + self.mlp(self.ln3(x))


class Captioner(nn.Module):
    def __init__(self, vocab=300, d=64, h=4, ctx=24):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.mem_proj = nn.Linear(32, d)
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(2)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, feats, feat_pad):
        T = ids.shape[1]
        causal = torch.full((T, T), float("-inf")).triu(1)
        x = self.tok(ids) + self.pos(torch.arange(T))
        mem = self.mem_proj(feats)
        for b in self.blocks:
            x = b(x, causal, mem, feat_pad)
        return self.head(self.ln_f(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    model = Captioner()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        feats = torch.randn(8, 10, 32)
        n_feat = torch.randint(3, 11, (8,))
        feat_pad = torch.arange(10)[None] >= n_feat[:, None]
        ids = torch.randint(0, 300, (8, 24))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(ids[:, :-1], feats, feat_pad)
            loss = F.cross_entropy(logits.reshape(-1, 300), ids[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
