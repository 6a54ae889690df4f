"""A 100-layer plain (non-residual) MLP with BatchNorm + ReLU on tabular data, fp16 autocast,
no GradScaler, no gradient clipping.

Yang et al. (2019, "A mean field theory of batch normalization"): in a deep non-residual BN
network the gradient grows geometrically from the output towards the input (about x1.2-1.5 per
layer), even though every activation is normalised. The forward pass is well behaved; the
backward pass through the first blocks overflows fp16, the inf gradients go straight into SGD
(no GradScaler to skip them) and the weights become NaN. --precision fp32 keeps finite (large)
gradients; --clip 1 trains.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def make_mlp(d_in=32, width=256, depth=100, n_cls=10):
    layers = [nn.Linear(d_in, width), nn.BatchNorm1d(width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU()]
    layers += [nn.Linear(width, n_cls)]
    return nn.Sequential(*layers)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    x_all = torch.randn(4096, 32)
    y_all = (x_all[:, :10] + 0.3 * torch.randn(4096, 10)).argmax(1)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(a.steps):
        idx = torch.randint(0, 4096, (128,))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=a.precision == "fp16"):
            logits = model(x_all[idx])
        loss = F.cross_entropy(logits.float(), y_all[idx])
        loss.backward()
        if a.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
