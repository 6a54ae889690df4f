"""Crashes: with gradient accumulation, scaler.unscale_() runs after every micro-batch.

An MLP with autocast (float16), GradScaler and 2 micro-batches per step. The loop unscales
after each backward (to clip), so the second micro-batch's unscale_ raises "RuntimeError:
unscale_() has already been called on this optimizer since the last update()." at step 0.
--fixed unscales once per step, after the last micro-batch.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fixed", action="store_true")
    args = parser.parse_args()

    model = nn.Sequential(nn.Linear(12, 48), nn.SiLU(), nn.Linear(48, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x_all, y_all = torch.randn(256, 12), torch.randn(256, 1)
    accum = 2

    for step in range(args.steps):
        optimizer.zero_grad()
        for micro in range(accum):
            i = (step * accum + micro) * 32 % 256
            with torch.autocast("cpu", dtype=torch.float16):
                pred = model(x_all[i:i + 32])
            loss = F.mse_loss(pred.float(), y_all[i:i + 32]) / accum
            scaler.scale(loss).backward()
            if not args.fixed:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if args.fixed:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
