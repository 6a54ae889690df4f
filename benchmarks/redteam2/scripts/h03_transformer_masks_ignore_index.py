"""HEALTHY: decoder-only transformer LM with hand-written attention, fp16 autocast + GradScaler.
A -inf causal mask and a torch.finfo(dtype).min padding mask are added to the fp16 scores (both
absorbed by the softmax: every row keeps at least its own position), and padded targets use
cross_entropy(ignore_index=-100).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
V, T = 300, 24


class Attention(nn.Module):
    def __init__(self, d, h=4):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.h = h

    def forward(self, x, pad):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(d // self.h)
        causal = torch.full((t, t), float("-inf")).triu(1).to(s.dtype)
        s = s + causal
        s = s.masked_fill(pad[:, None, None, :] & ~torch.eye(t, dtype=torch.bool), torch.finfo(s.dtype).min)
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, pad):
        x = x + self.attn(self.n1(x), pad)
        return x + self.mlp(self.n2(x))


class GPT(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.pos = nn.Parameter(torch.randn(T, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, V)

    def forward(self, ids, pad):
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x, pad)
        return self.head(x)


def main():
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(20):
        lens = torch.randint(8, T + 1, (16,))
        ids = torch.randint(1, V, (16, T + 1))
        ids[:, 1:] = torch.where(torch.rand(16, T) < 0.7, (ids[:, :-1] * 7 + 1) % V, ids[:, 1:])
        pad = torch.arange(T + 1) >= lens[:, None]
        ids = ids.masked_fill(pad, 0)
        tgt = ids[:, 1:].masked_fill(pad[:, 1:], -100)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(ids[:, :-1], pad[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, V), tgt.reshape(-1), ignore_index=-100)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
