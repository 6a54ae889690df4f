"""Activation checkpointing (torch.utils.checkpoint) around a block, CPU, float32.

    python checkpointed_block.py [--reentrant] [--plant | --plant-recompute]

The model is stem -> block (checkpointed: Linear, Tanh, Log) -> head; the block's forward runs
twice per step (once in forward, once recomputed in backward). With --plant, the block's ``Log``
takes the log (through a square root) of a negative number at step 2 (NaN), inside the
checkpointed block. With --plant-recompute, the loop changes that shift after the forward of
step 2 and before its backward: only the recomputation takes the square root of a negative
number. Prints ``step S loss X``.
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


class Log(nn.Module):
    def __init__(self):
        super().__init__()
        self.shift = 0.0

    def forward(self, x):
        # log(u) as 2 log(sqrt(u)): sqrt's backward reads its output, so a NaN that only the
        # recomputation makes reaches the gradients
        return 2.0 * torch.log(torch.sqrt(x.abs() + 1.0 - self.shift))


class Net(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Linear(6, 12)
        self.block = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), Log())
        self.head = nn.Linear(12, 2)

    def forward(self, x):
        h = self.stem(x)
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reentrant", action="store_true")
    parser.add_argument("--plant", action="store_true")
    parser.add_argument("--plant-recompute", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Net(args.reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        x = torch.randn(8, 6, requires_grad=args.reentrant)
        y = torch.randn(8, 2)
        model.block[2].shift = 3.0 if args.plant and step == 2 else 0.0  # |tanh| + 1 - 3 < 0
        loss = (model(x) - y).pow(2).mean()
        if args.plant_recompute and step == 2:
            model.block[2].shift = 3.0  # seen by the recomputation in backward only
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item()!r}", flush=True)


if __name__ == "__main__":
    main()
