"""Shared-QK transformer (Reformer-style) in fp16 autocast: loss nan at the first step.

Reported pattern: attention computed as (q @ k^T) / sqrt(d_head). q and k come from the same
projection, so the diagonal scores are |q|^2, which exceed 65504 in fp16 before the division
brings them back into range (scaling q by 1/sqrt(d) first, or fp32 scores, fixes it).
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class SharedQKAttention(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.h, self.dh = n_heads, d // n_heads
        self.qk = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        B, T, D = x.shape
        qk = self.qk(x).view(B, T, self.h, self.dh).transpose(1, 2)
        v = self.v(x).view(B, T, self.h, self.dh).transpose(1, 2)
        scores = torch.matmul(qk, qk.transpose(-2, -1)) / math.sqrt(self.dh)
        att = F.softmax(scores, dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(B, T, D))


class EncoderLayer(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.attn = SharedQKAttention(d, n_heads)
        self.norm1 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.norm2 = nn.LayerNorm(d)

    def forward(self, x):
        x = self.norm1(x + self.attn(x))  # post-LN: the attention sees the raw residual stream
        return self.norm2(x + self.ff(x))


class Classifier(nn.Module):
    def __init__(self, vocab=500, d=128, n_heads=2, n_layers=2, n_cls=4):
        super().__init__()
        self.d = d
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(64, d))
        self.layers = nn.ModuleList([EncoderLayer(d, n_heads) for _ in range(n_layers)])
        self.head = nn.Linear(d, n_cls)

    def forward(self, ids):
        # embeddings scaled by sqrt(d_model) as in "Attention is all you need"
        x = self.embed(ids) * math.sqrt(self.d) + self.pos[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))


def load_pretrained(model):
    # stand-in for the checkpoint: its shared QK projections grew during pretraining
    # ("attention logit growth", Dehghani et al. 2023), so raw scores are large
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.qk.weight.mul_(5.0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    args = p.parse_args()
    model = Classifier()
    load_pretrained(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    amp = args.precision == "fp16"
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    for step in range(args.steps):
        ids = torch.randint(0, 500, (8, 48))
        y = (ids < 250).sum(1) % 4
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            loss = F.cross_entropy(model(ids), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
