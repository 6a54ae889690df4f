"""Fails: a target made by log() of a zero in the data is -inf, and the loss of that batch is inf.

A regression of a log-quantity (log of a duration, a count, a price) with autocast (float16)
and GradScaler. The targets are computed once, up front, with torch.log(raw); a few raw values
are exactly 0, so their targets are -inf. The model's inputs and outputs stay finite: the bad
value is in the target the loss function receives, not made by any op of the model. GradScaler
skips that step and the run goes on, so the printed loss is inf once and then looks fine.
--arch mlp: a tabular MLP; --arch conv1d: a 1-D convolutional net over a sequence.
--fixed takes log1p of the raw values (finite for 0): no inf anywhere.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

BATCH = 32
BAD_STEP = 3  # the batch that holds the zero
BAD_ROWS = (5, 21)  # its positions in that batch


def make_data(arch: str, n: int = 256, fixed: bool = False):
    if arch == "mlp":
        x = torch.randn(n, 10)
        raw = torch.exp(1 + x[:, :2].sum(1) * 0.4 + 0.1 * torch.randn(n))
    else:
        x = torch.randn(n, 4, 32)
        raw = torch.exp(0.5 + x[:, 0].mean(1) + 0.1 * torch.randn(n))
    for r in BAD_ROWS:
        raw[BAD_STEP * BATCH + r] = 0.0  # an empty record in the export
    y = torch.log1p(raw) if fixed else torch.log(raw)
    return x, y[:, None]


def make_model(arch: str) -> nn.Module:
    if arch == "mlp":
        return nn.Sequential(nn.Linear(10, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                             nn.Linear(64, 1))
    return nn.Sequential(nn.Conv1d(4, 16, 5, padding=2), nn.ReLU(),
                         nn.Conv1d(16, 16, 5, padding=2), nn.ReLU(),
                         nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(16, 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", choices=("mlp", "conv1d"), default="mlp")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fixed", action="store_true")
    args = parser.parse_args()
    x_all, y_all = make_data(args.arch, fixed=args.fixed)
    model = make_model(args.arch)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x = x_all[step * BATCH:(step + 1) * BATCH]
        y = y_all[step * BATCH:(step + 1) * BATCH]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")


if __name__ == "__main__":
    main()
