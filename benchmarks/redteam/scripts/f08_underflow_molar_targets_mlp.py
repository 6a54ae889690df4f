"""Regressing concentrations in mol/L with fp16 autocast and no GradScaler: nothing trains.

Reported pattern: targets are kept in raw SI units (micromolar concentrations, ~1e-6 mol/L).
The regression head is zero-initialised (a common trick for regression heads), so the MSE
gradient dL/dpred = 2 (pred - y) / N is ~1e-8: representable in float32, but it flushes to zero
when autocast casts it back to the head's float16 output. Every gradient is exactly zero, SGD
never moves, and the loss stays flat, while the same script in float32 (--precision fp32)
learns. (GradScaler, or targets in micromolar, fixes it.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class AssayRegressor(nn.Module):
    def __init__(self, d_in=32, hidden=128, n_out=4):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.head = nn.Linear(hidden, n_out)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):
        return self.head(self.body(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    args = p.parse_args()
    model = AssayRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    w_true = torch.randn(32, 4)
    for step in range(args.steps):
        x = torch.randn(64, 32)
        y = 2e-6 * torch.sigmoid(x @ w_true) + 1e-7  # concentrations in mol/L
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=args.precision == "fp16"):
            pred = model(x)
        loss = F.mse_loss(pred.float(), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4e}")


if __name__ == "__main__":
    main()
