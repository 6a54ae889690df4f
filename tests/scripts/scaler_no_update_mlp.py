"""Crashes: scaler.step() is called every step but scaler.update() never is.

GradScaler needs update() after each step(): it resets the per-optimizer state and adjusts the
scale. Without it the second scaler.step(optimizer) raises
"RuntimeError: step() has already been called since the last update()." at step 1.
--fixed calls scaler.update() after scaler.step(optimizer).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fixed", action="store_true")
    args = parser.parse_args()

    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x_all, y_all = torch.randn(128, 10), torch.randn(128, 1)

    for step in range(args.steps):
        idx = torch.arange(step * 32, (step + 1) * 32) % len(x_all)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x_all[idx])
        loss = F.mse_loss(pred.float(), y_all[idx])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        if args.fixed:
            scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
