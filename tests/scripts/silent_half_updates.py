"""Learns less in float16 without any NaN: a ``.half()`` linear regression whose SGD updates are
smaller than float16's spacing near its weights, so most of them round away.

The weights start at 100 (float16's spacing there is 2^-4 = 0.0625) and should move to about
96; each SGD update is about 0.016, under half the spacing: in float16 ``w - lr * g`` rounds
back to ``w`` and the loss does not move, while the same script in float32 (``--fp32``)
learns. Nothing overflows
or underflows; no step is non-finite. Prints ``step N loss X``.
"""

import argparse

import torch
import torch.nn as nn

torch.manual_seed(0)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fp32", action="store_true")
    args = p.parse_args()

    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(64, 16, generator=g)
    true_w = torch.randn(16, 1, generator=g) * 0.5 + 96.0
    y_all = x_all @ true_w
    model = nn.Linear(16, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(100.0)
    if not args.fp32:
        model.half()
    optimizer = torch.optim.SGD(model.parameters(), lr=2e-3)
    for step in range(args.steps):
        x = x_all if args.fp32 else x_all.half()
        optimizer.zero_grad()
        loss = ((model(x).float() - y_all) ** 2).mean()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
