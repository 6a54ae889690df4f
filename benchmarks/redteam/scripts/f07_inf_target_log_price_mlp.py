"""Tabular price regression (MLP) predicting log-prices, fp16 autocast + GradScaler.

Reported pattern: "loss is inf at one step, then training goes on as if nothing happened".
The target transform np.log(price) maps the listings with price 0 (free items in the export)
to -inf; the batch of step 4 contains one. The model's inputs and outputs are all finite: the
bad value is in the target itself. (Filter or clip the targets, e.g. log1p.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def load_table(n=1024, d=12):
    x = torch.randn(n, d)
    price = torch.exp(2 + x[:, :3].sum(1) * 0.5 + 0.1 * torch.randn(n))
    price[4 * 64 + 17] = 0.0  # a free listing
    return x, torch.log(price)[:, None]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    x_all, y_all = load_table()
    model = nn.Sequential(nn.Linear(12, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(),
                          nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x, y = x_all[step * 64:(step + 1) * 64], y_all[step * 64:(step + 1) * 64]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x)
            loss = F.mse_loss(pred, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
