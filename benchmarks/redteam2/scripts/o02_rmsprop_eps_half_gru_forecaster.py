"""GRU load forecaster converted to fp16 with model.half() and trained with RMSprop (eps=1e-8).

RMSprop keeps square_avg = alpha * square_avg + (1 - alpha) * g^2 in the parameter's dtype. In
fp16 eps=1e-8 rounds to 0 and, for the many small gradients (|g| < ~2.4e-3), (1 - alpha) * g^2
underflows to 0 too, so the update g / (sqrt(0) + 0) = +-inf is written into the weights at the
first step; the next forward is NaN. --precision fp32 trains.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Forecaster(nn.Module):
    def __init__(self, n_feat=8, hidden=64, horizon=6):
        super().__init__()
        self.gru = nn.GRU(n_feat, hidden, batch_first=True)
        self.head = nn.Linear(hidden, horizon)

    def forward(self, x):
        h, _ = self.gru(x)
        return self.head(h[:, -1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    dt = torch.float16 if a.precision == "fp16" else torch.float32
    t = torch.arange(20000).float()
    load = torch.sin(2 * torch.pi * t / 24) + 0.3 * torch.sin(2 * torch.pi * t / 168) + 0.1 * torch.randn(20000)
    feats = torch.stack([load] + [torch.sin(2 * torch.pi * t / p_) for p_ in (24, 168, 12)] +
                        [torch.cos(2 * torch.pi * t / p_) for p_ in (24, 168, 12, 6)], -1)
    model = Forecaster().to(dt)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, eps=1e-8)
    for step in range(a.steps):
        starts = torch.randint(0, 20000 - 60, (64,))
        x = torch.stack([feats[s:s + 48] for s in starts]).to(dt)
        y = torch.stack([load[s + 48:s + 54] for s in starts])
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
