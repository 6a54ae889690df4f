"""Fails: optimizer.step() is called outside scaler.step(), so the steps GradScaler would skip
are applied.

An MLP regressor trained with autocast (float16) and GradScaler. The loss is summed
(reduction="sum"), so at GradScaler's default scale 2**16 the scaled gradients overflow float16
on the first steps: that is normal calibration, GradScaler skips those steps. But the loop calls
scaler.unscale_(optimizer), clips, and then optimizer.step() itself instead of
scaler.step(optimizer): the inf/NaN gradients of the very first step are applied and every
weight of the first layers becomes NaN at step 0, with no large update before.
--fixed calls scaler.step(optimizer) (clipping after unscale_, the correct order): trains.
--double calls scaler.step(optimizer) and then optimizer.step() as well (a leftover line):
every update is applied twice, and step 0's skipped update is applied anyway.
--leftover calls scaler.step(optimizer), scaler.update() and then optimizer.step(): the same
leftover line, after the update.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fixed", action="store_true")
    parser.add_argument("--double", action="store_true")
    parser.add_argument("--leftover", action="store_true")
    args = parser.parse_args()

    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x_all = torch.randn(512, 16)
    y_all = x_all[:, :4] * 2 + 0.1 * torch.randn(512, 4)

    for step in range(args.steps):
        idx = torch.arange(step * 128, (step + 1) * 128) % len(x_all)
        x, y = x_all[idx], y_all[idx]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x)
        loss = F.mse_loss(pred.float(), y, reduction="sum")
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
        if args.fixed:
            scaler.step(optimizer)
        elif args.double:
            scaler.step(optimizer)
            optimizer.step()
        elif args.leftover:
            scaler.step(optimizer)
        else:
            optimizer.step()
        scaler.update()
        if args.leftover:
            optimizer.step()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")


if __name__ == "__main__":
    main()
