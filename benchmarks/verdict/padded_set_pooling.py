"""Fails: attention pooling over a set whose one record is all padding (a softmax over a row that
is -inf everywhere: NaN), at step 4 only. Not precision-specific: float32 fails the same way.

A set encoder (per-element MLP, a learned query, masked attention pooling, a linear head); the
batch of step 4 holds a set whose every element is padding. Autocast fp16 + GradScaler on CPU.
Fix by hand: give a fully padded set a finite score row (``scores.masked_fill(mask, -1e4)`` in
float32, or skip empty sets). Prints ``step N loss X``.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class SetPool(nn.Module):
    def __init__(self, d_in=8, d=32):
        super().__init__()
        self.element = nn.Sequential(nn.Linear(d_in, d), nn.ReLU(), nn.Linear(d, d))
        self.query = nn.Parameter(torch.randn(d) / d ** 0.5)
        self.head = nn.Linear(d, 3)

    def forward(self, x, pad):
        h = self.element(x)
        scores = (h @ self.query).float().masked_fill(pad, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        pooled = (weights.unsqueeze(-1) * h.float()).sum(dim=1)
        return self.head(pooled)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 10, 8, generator=g)
    lengths = torch.randint(1, 11, (16,), generator=g)
    if step == 4:
        lengths[5] = 0  # an empty set
    pad = torch.arange(10)[None, :] >= lengths[:, None]
    y = (x[:, 0, 0] > 0).long() + (x[:, 0, 1] > 0).long()
    return x, pad, y


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    model = SetPool()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x, pad, y = batch(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x, pad), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
