"""Precision loss without NaN: rotary position angles computed in float16 (model.half()).

A one-block transformer trained as `model.half()` on 1024-token sequences. `block.rope`
computes its angles as positions * inverse frequencies in the model's dtype: in float16 the
spacing near position 1000 is 0.5, so the rotation of late tokens is off by up to 0.25 rad
(the RoPE precision issue of transformers PR #29285). Nothing is non-finite; `nanhunt audit`
should rank `block.rope` first and advise float32 for it.
Modules: "" (TinyLM), "embed", "block" (Block), "block.qkv" (Linear), "block.rope" (Rotary),
"block.proj" (Linear), "block.norm" (LayerNorm), "head" (Linear).
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Rotary(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", base ** (-torch.arange(0, dim, 2).float() / dim))

    def forward(self, x):  # x: (batch, seq, dim)
        pos = torch.arange(x.shape[1], dtype=x.dtype)
        angles = pos[:, None] * self.inv_freq[None, :].to(x.dtype)
        cos, sin = torch.cos(angles), torch.sin(angles)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        nn.init.normal_(self.qkv.weight, std=0.5)  # sharp attention: positions matter
        self.rope = Rotary(d)
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = self.rope(q), self.rope(k)
        att = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return self.norm(x + self.proj(att @ v))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.block = Block(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    model = TinyLM().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        ids = torch.randint(0, 64, (2, 1025))
        opt.zero_grad()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 64), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
