"""A small MLP regression trained in a chosen precision, each path written out by hand.

The reference for the experiment ladder's whole-program fixes (nanhunt.rungs): each fix
applied from outside to the float16 run must give exactly the losses of the path this script
spells out itself:

  --style autocast  autocast(dtype) + GradScaler (float16 only, ``--scaler`` to force)
  --style half      model.half() / model.bfloat16() and x.half() / x.to(bfloat16), no scaler
  --dtype float16|bfloat16|float32
  --replace-input N at step N the model gets step N-1's input and the loss step N-1's labels

Prints ``step N loss X`` (loss.item() with full precision, for exact comparison).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(32, 8, generator=g)
    return x, x[:, :2].sum(dim=1, keepdim=True) * 0.5


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--style", choices=("autocast", "half"), default="autocast")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    p.add_argument("--scaler", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--replace-input", type=int, default=None)
    args = p.parse_args()
    dtype = DTYPES[args.dtype]

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if args.style == "half" and dtype == torch.float16:
        model.half()
    elif args.style == "half" and dtype == torch.bfloat16:
        model.bfloat16()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    use_scaler = args.style == "autocast" and (
        args.scaler == "on" or (args.scaler == "auto" and dtype == torch.float16))
    scaler = torch.amp.GradScaler("cpu", enabled=use_scaler)
    previous = None
    for step in range(args.steps):
        x, y = batch(step)
        if args.replace_input is not None and step == args.replace_input:
            x, y = previous
        previous = x, y
        if args.style == "half" and dtype == torch.float16:
            x = x.half()
        elif args.style == "half" and dtype == torch.bfloat16:
            x = x.to(torch.bfloat16)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype if dtype != torch.float32 else torch.bfloat16,
                            enabled=args.style == "autocast" and dtype != torch.float32):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item()!r}")


if __name__ == "__main__":
    main()
