"""HEALTHY: tabular MLP regressor (log-price targets), fp16 autocast + GradScaler with the
default init_scale 2^16, and a warm-up + cosine LR schedule that is stepped only when the
optimizer really stepped.

At 2^16 the first step(s) overflow and GradScaler skips them while it calibrates the scale;
that is normal, and the run then trains. The scheduler follows the recommended pattern
(don't call scheduler.step() when scaler.update() lowered the scale).
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=25)
    args = p.parse_args()
    x_all = torch.randn(2048, 12)
    y_all = (2 + 0.5 * x_all[:, :3].sum(1, keepdim=True) + 0.1 * torch.randn(2048, 1))
    model = nn.Sequential(nn.Linear(12, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(),
                          nn.Linear(128, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    warm = 5
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * s / 40)))
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        idx = torch.randint(0, 2048, (128,))
        x, y = x_all[idx], y_all[idx]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() >= scale_before:  # the optimizer stepped
            sched.step()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f} "
              f"lr {sched.get_last_lr()[0]:.2e}")


if __name__ == "__main__":
    main()
