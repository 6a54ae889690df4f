"""An fp32 run to audit before switching: Fourier features whose phases need float32's mantissa.

A coordinate MLP (NeRF-style random Fourier features) trains in plain float32: `encode`
computes sin/cos of B x with B's entries around 100, so the phases reach several hundred
radians. Under autocast, B x comes out of a matmul in float16 (spacing 0.25-0.5 at those
magnitudes) or bfloat16 (spacing 2-4): the phases, and so the features, are wrong by far more
than rounding alone would be. `nanhunt audit --target float16,bfloat16` should rank `encode`
first in both and advise float32 for it.
Modules: "" (CoordMLP), "encode" (FourierFeatures), "encode.proj" (Linear), "fc" (Linear),
"act" (ReLU), "out" (Linear).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class FourierFeatures(nn.Module):
    def __init__(self, d_in=2, n=32, scale=100.0):
        super().__init__()
        self.proj = nn.Linear(d_in, n, bias=False)
        nn.init.normal_(self.proj.weight, std=scale)

    def forward(self, x):
        phase = self.proj(x)
        return torch.cat([torch.sin(phase), torch.cos(phase)], dim=-1)


class CoordMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.encode = FourierFeatures()
        self.fc, self.act = nn.Linear(64, 64), nn.ReLU()
        self.out = nn.Linear(64, 1)
        nn.init.normal_(self.out.weight, std=0.5)  # outputs on the targets' scale from the start

    def forward(self, x):
        return self.out(self.act(self.fc(self.encode(x))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    model = CoordMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        x = torch.rand(32, 2) * 2 - 1
        y = torch.sin(3 * x[:, :1]) * torch.cos(2 * x[:, 1:])
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
