"""Fails: sqrt(0) in a hand-written RMS norm is finite in the forward but NaN in the backward.

Plain fp32 (no autocast, no GradScaler), so the NaN gradient reaches the optimizer.
`RMSNorm` (module "norm") computes rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True)) with no eps
inside the sqrt and only clamps rms before dividing, which keeps the forward finite.  The batch of
step 2 holds an all-zero sample (row 3, an empty record), so the input of "norm" has an all-zero
row: forward gives sqrt(0) = 0, clamp -> 1e-6, 0 / 1e-6 = 0 (all finite), but backward gives
grad / (2 * sqrt(0)) = 0 / 0 = NaN.
Expected first non-finite value:
  step 2 (0-based), phase backward, module "norm" (RMSNorm), tensor grad_input[0] (NaN in row 3);
  its grad_output[0] is finite, and everything in steps 0-1 and in the forward of step 2 is finite.
Then proj.weight.grad is NaN, SGD writes NaN into "proj.weight" (optimizer phase, step 2) and every
later step is NaN (loss prints nan from step 3 on).
Fix: put eps inside the sqrt: torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) (or torch.rsqrt).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class RMSNorm(nn.Module):
    def forward(self, x):
        rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True))
        return x / rms.clamp(min=1e-6)  # clamp avoids 0/0 in the forward only


class Net(nn.Module):
    def __init__(self, d_in=16, d_hidden=32, n_classes=4):
        super().__init__()
        self.proj = nn.Linear(d_in, d_hidden, bias=False)
        self.norm = RMSNorm()
        self.act = nn.GELU()
        self.head = nn.Linear(d_hidden, n_classes)

    def forward(self, x):
        return self.head(self.act(self.norm(self.proj(x))))


def make_batch(step, batch_size=16, d_in=16):
    x = torch.randn(batch_size, d_in)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    if step == 2:
        x[3] = 0.0  # an empty record
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    for step in range(args.steps):
        x, y = make_batch(step)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
