"""Healthy: a small MLP classifier that trains finitely under autocast fp16 + GradScaler.

Expected: no non-finite value at any step, phase or module; GradScaler skips no step
(scale stays 65536.0) and the loss goes down over the default 20 steps.
Modules (model.named_modules()): "", "net", "net.0" (Linear), "net.1" (GELU),
"net.2" (LayerNorm), "net.3" (Linear), "net.4" (GELU), "head" (Linear).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class MLP(nn.Module):
    def __init__(self, d_in=32, d_hidden=64, n_classes=4):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, d_hidden),
            nn.GELU(),
            nn.LayerNorm(d_hidden),
            nn.Linear(d_hidden, d_hidden),
            nn.GELU(),
        )
        self.head = nn.Linear(d_hidden, n_classes)

    def forward(self, x):
        return self.head(self.net(x))


def make_data(n=512, d_in=32, n_classes=4):
    centers = torch.randn(n_classes, d_in) * 2
    y = torch.randint(0, n_classes, (n,))
    x = centers[y] + torch.randn(n, d_in)
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    x_all, y_all = make_data()
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cpu")

    for step in range(args.steps):
        idx = torch.arange(step * args.batch_size, (step + 1) * args.batch_size) % len(x_all)
        x, y = x_all[idx], y_all[idx]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
