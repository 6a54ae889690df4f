"""GRU forecaster on sensor time series (fp16 autocast + GradScaler): loss nan at step 3.

Reported pattern: a CSV of sensor readings has empty cells (a sensor dropped out); pandas reads
them as NaN and the windowing code passes them straight into the batch. The batch of step 3
contains a window with NaN readings; the loss is nan and GradScaler skips the step.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def load_series(n=4000, ch=6):
    t = torch.arange(n, dtype=torch.float32)
    base = torch.stack([torch.sin(t / (20 + 7 * c)) for c in range(ch)], 1)
    series = base + 0.1 * torch.randn(n, ch)
    series[1390:1396, 2] = float("nan")  # the sensor dropout: empty CSV cells
    return series


class Forecaster(nn.Module):
    def __init__(self, ch=6, hidden=48):
        super().__init__()
        self.inp = nn.Linear(ch, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, ch)

    def forward(self, x):
        h, _ = self.gru(torch.tanh(self.inp(x)))
        return self.head(h[:, -1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    series = load_series()
    model = Forecaster()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    win, bs = 40, 16
    for step in range(args.steps):
        starts = torch.arange(step * bs, (step + 1) * bs) * 29  # walk through the series
        x = torch.stack([series[s:s + win] for s in starts])
        y = torch.stack([series[s + win] for s in starts])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x)
        loss = F.mse_loss(pred.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
