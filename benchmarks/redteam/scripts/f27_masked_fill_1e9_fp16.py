"""Annotated-Transformer-style attention with scores.masked_fill(mask == 0, -1e9), run under
fp16 autocast.

Reported pattern: the first forward under AMP raises
"RuntimeError: value cannot be converted to type at::Half without overflow": the scores are
float16 under autocast and -1e9 is far outside float16's range (max 65504).
(torch.finfo(scores.dtype).min, or float("-inf"), fixes it.)
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def attention(query, key, value, mask=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    return torch.matmul(p_attn, value)


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model):
        super().__init__()
        self.d_k, self.h = d_model // h, h
        self.linears = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(4)])

    def forward(self, query, key, value, mask=None):
        B = query.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1)
        q, k, v = [lin(x).view(B, -1, self.h, self.d_k).transpose(1, 2)
                   for lin, x in zip(self.linears, (query, key, value))]
        x = attention(q, k, v, mask=mask)
        return self.linears[-1](x.transpose(1, 2).contiguous().view(B, -1, self.h * self.d_k))


class EncoderLayer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.self_attn = MultiHeadedAttention(h, d)
        self.norm1 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d))
        self.norm2 = nn.LayerNorm(d)

    def forward(self, x, mask):
        y = self.norm1(x)
        x = x + self.self_attn(y, y, y, mask)
        return x + self.ff(self.norm2(x))


class Encoder(nn.Module):
    def __init__(self, vocab=1000, d=64, h=4, n=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.layers = nn.ModuleList([EncoderLayer(d, h) for _ in range(n)])
        self.head = nn.Linear(d, 2)

    def forward(self, ids):
        mask = (ids != 0).unsqueeze(-2)
        x = self.embed(ids) * math.sqrt(64)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x[:, 0])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    model = Encoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        ids = torch.randint(1, 1000, (8, 20))
        ids[:, 15:] = 0
        y = ids[:, 1] % 2
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(ids), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
