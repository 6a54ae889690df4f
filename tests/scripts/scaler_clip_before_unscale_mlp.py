"""Broken: clip_grad_norm_ runs on the scaled gradients (before scaler.unscale_()).

An MLP classifier with autocast (float16) and GradScaler; clipping with max_norm=5.0 before
unscaling clips the gradients to 5/65536 of their norm: the loss stays finite and barely moves.
--fixed unscales first.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fixed", action="store_true")
    args = parser.parse_args()

    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x_all = torch.randn(256, 20)
    y_all = (x_all[:, 0] > 0).long() + (x_all[:, 1] > 0).long()

    for step in range(args.steps):
        idx = torch.arange(step * 64, (step + 1) * 64) % len(x_all)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x_all[idx])
        loss = F.cross_entropy(logits.float(), y_all[idx])
        scaler.scale(loss).backward()
        if args.fixed:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
