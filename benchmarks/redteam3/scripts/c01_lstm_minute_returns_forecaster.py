"""LSTM forecaster of next-minute log returns (synthetic AR(1) series, returns ~1e-5), fp16
autocast on CPU to speed up the matmuls. The LSTM cell is written out with nn.Linear gates
(nn.LSTM has no fp16 CPU kernel); the head starts from the zero forecast. Loss: MSE over every
time step of every series (the returns are tiny, so the learning rate is small too).

    python c01_lstm_minute_returns_forecaster.py [--fp32] [--scaler] [--steps N] [--lr LR]
--scaler adds torch.amp.GradScaler.
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--scaler", action="store_true")
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--lr", type=float, default=4e-7)
a = ap.parse_args()
torch.manual_seed(0)
B, T, H = 64, 48, 32


class LSTM(nn.Module):
    def __init__(s, i, h):
        super().__init__()
        s.h = h
        s.ih, s.hh = nn.Linear(i, 4 * h), nn.Linear(h, 4 * h, bias=False)

    def forward(s, x):
        h = c = x.new_zeros(x.shape[0], s.h)
        out = []
        for t in range(x.shape[1]):
            i, f, gg, o = (s.ih(x[:, t]) + s.hh(h)).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
            h = torch.sigmoid(o) * torch.tanh(c)
            out.append(h)
        return torch.stack(out, 1)


class Forecaster(nn.Module):
    def __init__(s):
        super().__init__()
        s.lstm = LSTM(1, H)
        s.head = nn.Linear(H, 1)
        nn.init.zeros_(s.head.weight)
        nn.init.zeros_(s.head.bias)

    def forward(s, x):
        return s.head(s.lstm(x)).squeeze(-1)


def series(g):
    r = torch.zeros(B, T + 1)
    noise = 6e-6 * torch.randn(B, T + 1, generator=g)
    for t in range(1, T + 1):
        r[:, t] = 0.8 * r[:, t - 1] + noise[:, t]
    return r


model = Forecaster()
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=a.scaler and not a.fp32)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    r = series(g)
    x, y = r[:, :-1, None], r[:, 1:]
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        pred = model(x * 5e4)  # inputs rescaled to ~0.5
        loss = F.mse_loss(pred.float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4e}", flush=True)
