"""Fails silently: optimizer.zero_grad() sits between scaler.unscale_() and scaler.step().

The loop unscales (to clip or log the gradients) and then clears them, so scaler.step() finds no
gradient and the optimizer applies nothing: the loss never moves, nothing is ever non-finite.
--arch mlp: a regressor; --arch cnn: a small conv classifier.
--fixed calls zero_grad() at the start of the iteration: it trains. --lr 0 is the reference for
"nothing applied": the bug's losses equal its losses step for step.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fixed", action="store_true")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    if args.arch == "mlp":
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        x_all, y_all = torch.randn(256, 16), torch.randn(256, 1)
    else:
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                              nn.Flatten(), nn.Linear(8, 1))
        x_all, y_all = torch.randn(256, 3, 8, 8), torch.randn(256, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(args.steps):
        x, y = x_all[step * 32:(step + 1) * 32], y_all[step * 32:(step + 1) * 32]
        if args.fixed:
            optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not args.fixed:
            optimizer.zero_grad()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")


if __name__ == "__main__":
    main()
