"""Small transformer LM, fp16 autocast + GradScaler, AdamW with lr=1.0 (meant 1e-3... typo).

Reported pattern: "loss explodes then nan after ~10 steps". Adam moves every weight by about
lr per step whatever the gradient, so with lr=1.0 the weights of the MLP blocks grow by ~1 per
step; their products grow quadratically and after several steps an FFN output exceeds float16's
max. The loss climbs steadily before that. --lr 1e-3 trains.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        a = self.ln1(x)
        x = x + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=256, d=64, h=4, n=2, ctx=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(n)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        T = ids.shape[1]
        mask = torch.triu(torch.full((T, T), float("-inf")), 1)
        x = self.tok(ids) + self.pos(torch.arange(T))
        for b in self.blocks:
            x = b(x, mask)
        return self.lm_head(self.ln_f(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1.0)
    args = p.parse_args()
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu")
    data = torch.randint(0, 256, (4096,))
    data[1::2] = (data[0::2] + 1) % 256
    for step in range(args.steps):
        s = torch.randint(0, 4096 - 33, (8,))
        x = torch.stack([data[i:i + 32] for i in s])
        y = torch.stack([data[i + 1:i + 33] for i in s])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
