"""Precision loss without NaN: a set MLP (DeepSets) whose sum pooling accumulates in float16.

Each sample is a set of 3000 elements; an element-wise MLP embeds them and `pool` adds the
embeddings one element at a time (a running sum), under torch.autocast("cpu", float16) +
GradScaler. The sum grows past 2^11 times an addend and float16 rounds later addends away.
Nothing is non-finite; `nanhunt audit` should rank `pool` first and advise float32 for it.
Modules: "" (DeepSet), "phi" (Sequential), "phi.0" (Linear), "phi.1" (Softplus),
"pool" (RunningSum), "rho" (Linear).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class RunningSum(nn.Module):
    def forward(self, h):
        acc = torch.zeros_like(h[:, 0])
        for i in range(h.shape[1]):
            acc = acc + h[:, i]
        return acc / h.shape[1]


class DeepSet(nn.Module):
    def __init__(self, d_in=4, d=8, n_classes=3):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(d_in, d), nn.Softplus())
        self.pool = RunningSum()
        self.rho = nn.Linear(d, n_classes)

    def forward(self, x):
        return self.rho(self.pool(self.phi(x)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    model = DeepSet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x = torch.randn(4, 3000, 4) + 1.0
        y = torch.randint(0, 3, (4,))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
