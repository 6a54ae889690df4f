"""Fails: a retrieval scorer's attention logits ``q @ k.T`` overflow float16 under autocast
(query and key projections whose outputs grow to ~300 each, 64 dimensions: dot products past
65504) at step 3, when the inputs' scale doubles; the softmax of inf is NaN. A precision
failure of float16's range: float32 and bfloat16 train. Fix by hand: scale the logits by
1/sqrt(d) before the matmul, or compute ``q @ k.T`` in float32. Prints ``step N loss X``.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Scorer(nn.Module):
    def __init__(self, d_in=16, d=64):
        super().__init__()
        self.q = nn.Linear(d_in, d)
        self.k = nn.Linear(d_in, d)
        self.out = nn.Linear(d_in, 1)

    def forward(self, queries, docs):
        logits = self.q(queries) @ self.k(docs).transpose(-1, -2)
        attn = torch.softmax(logits, dim=-1)
        return self.out(attn @ docs)


def batch(step):
    g = torch.Generator().manual_seed(step)
    scale = 20.0 if step < 3 else 160.0  # the inputs' units change at step 3
    queries = torch.randn(8, 4, 16, generator=g) * scale
    docs = torch.randn(8, 12, 16, generator=g) * scale
    y = docs[:, :4, :1].mean(dim=1, keepdim=True).expand(8, 4, 1) / scale
    return queries, docs, y


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    model = Scorer()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        q, d, y = batch(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(q, d).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
