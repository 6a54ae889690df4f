"""Fails silently: regression on targets in raw SI units; without a GradScaler the fp16 gradient
of the model output flushes to zero and nothing trains.

Autocast fp16, fp32 parameters, no GradScaler (``--scaler`` adds one: the healthy control;
``--fp32`` runs without autocast: the float32 reference).  The targets are absorbances in raw
units (~1e-5, never rescaled) and the head is initialised to that scale, so the prediction error
is ~1e-5 and d(mse)/d(prediction) = 2 * error / (256 * 8) ~ 1e-8 in float32.  Autocast runs the
head in fp16 and mse_loss in fp32: in backward the float32 gradient is cast to fp16 at the head's
output, where 1e-8 is below fp16's smallest subnormal (5.96e-8) and becomes exactly 0.
Expected: no non-finite value; every step, phase backward, module "head" (the last fp16 module,
first in backward order): its grad_output[0] is non-zero in float32 and (almost) all zero in fp16;
every parameter gradient is then 0 and the weights never change.  Fix: GradScaler (an init_scale
that lifts the ~2^-27 gradients into fp16's normal range), or rescale the targets.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Regressor(nn.Module):
    def __init__(self, d_in=32, d_hidden=128, d_out=8):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(),
                                  nn.Linear(d_hidden, d_hidden), nn.GELU())
        self.head = nn.Linear(d_hidden, d_out)
        with torch.no_grad():  # start predictions at the targets' scale
            self.head.weight.mul_(1e-5)
            self.head.bias.zero_()

    def forward(self, x):
        return self.head(self.body(x))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--scaler", action="store_true", help="use a GradScaler (healthy)")
    parser.add_argument("--fp32", action="store_true", help="no autocast (float32 reference)")
    args = parser.parse_args()

    w_true = torch.randn(32, 8) * 1e-5  # absorbance per unit concentration, raw units
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu") if args.scaler else None
    for step in range(args.steps):
        x = torch.randn(256, 32)
        y = x @ w_true + 1e-6 * torch.randn(256, 8)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=not args.fp32):
            loss = F.mse_loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        print(f"step {step} loss {loss.item():.4e}")


if __name__ == "__main__":
    main()
