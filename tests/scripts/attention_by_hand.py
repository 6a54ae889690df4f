"""A small causal-attention language model whose attention is written by hand, float16 autocast.

    python attention_by_hand.py --plant scores   # the q @ k^T line overflows float16 at step 3
    python attention_by_hand.py --plant padded   # step 3's first sequence is padding only

--plant scores: from step 3 the query and key projections' outputs are scaled by 300 (a
temperature gone wrong), so ``q @ k.transpose(-2, -1)``, written on the script's own line,
overflows float16 while q and k stay finite (below 2000); in float32 the scores are finite and
the softmax on the following lines takes them.
--plant padded: at step 3 every key of the first sequence is padding: its attention rows are -inf
throughout and the softmax is 0/0 (NaN) in any precision; a finite fill
(``--fill finfo``: ``torch.finfo(att.dtype).min`` instead of -inf) keeps it finite.
Prints ``step N loss X``.
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
VOCAB, T, D = 32, 12, 32


class SelfAttention(nn.Module):
    def __init__(self, fill):
        super().__init__()
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, D)
        self.v = nn.Linear(D, D)
        self.proj = nn.Linear(D, D)
        self.fill = fill
        self.boost = 1.0

    def forward(self, x, pad):
        q, k, v = self.q(x) * self.boost, self.k(x) * self.boost, self.v(x)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        blocked = causal | pad[:, None, :]
        fill = torch.finfo(att.dtype).min if self.fill == "finfo" else float("-inf")
        att = att.masked_fill(blocked, fill)
        att = torch.softmax(att, dim=-1)
        return self.proj(att @ v)


class TinyLM(nn.Module):
    def __init__(self, fill):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.attn = SelfAttention(fill)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx, pad):
        h = self.emb(idx)
        h = h + self.attn(h, pad)
        return self.head(self.norm(h))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--plant", choices=["scores", "padded"], default=None)
    p.add_argument("--fill", choices=["-inf", "finfo"], default="-inf")
    args = p.parse_args()
    model = TinyLM(args.fill)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, VOCAB, (4, T + 1), generator=g)
        pad = torch.zeros(4, T, dtype=torch.bool)
        if args.plant == "padded" and step == 3:
            pad[0] = True
        if args.plant == "scores" and step >= 3:
            model.attn.boost = 300.0
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(idx[:, :-1], pad)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
