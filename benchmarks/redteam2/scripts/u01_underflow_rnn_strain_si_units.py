"""Strain-gauge forecaster (nn.RNN) on targets in raw SI units, fp16 autocast, no GradScaler.

Structural-health-monitoring data: the target is mechanical strain in m/m (micro-strain, ~1e-6),
kept in SI units. The head is zero-initialised ("start the regression at 0"), so the MSE gradient
dL/dpred = 2 (pred - y) / N is ~1e-9: fine in float32, but below fp16's smallest subnormal
(6e-8) when autocast casts it back to the head's float16 output. Every gradient is zero and the
loss never moves; --precision fp32 learns.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class StrainForecaster(nn.Module):
    def __init__(self, n_sensors=6, hidden=64, horizon=8):
        super().__init__()
        self.inp = nn.Linear(n_sensors, hidden)
        self.rnn = nn.RNN(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, horizon)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):
        h, _ = self.rnn(torch.tanh(self.inp(x)))
        return self.head(h[:, -1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    model = StrainForecaster()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    load = torch.randn(512, 40, 6)                       # normalised load-cell readings
    strain = 3e-6 * torch.sigmoid(load[:, -8:, :].mean(-1)) + 1e-6  # m/m, ~1e-6
    for step in range(a.steps):
        idx = torch.randint(0, 512, (64,))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=a.precision == "fp16"):
            pred = model(load[idx])
        loss = F.mse_loss(pred.float(), strain[idx])
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4e}")


if __name__ == "__main__":
    main()
