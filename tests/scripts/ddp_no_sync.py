"""DDP gradient accumulation with no_sync (gloo, CPU, 2 ranks under torchrun): each optimizer
step accumulates --micro micro-batches, all but the last under ``model.no_sync()``.

    torchrun --standalone --nproc-per-node 2 ddp_no_sync.py [--nan-rank 1 --nan-step 2]

Rank R's first micro-batch of step S holds a NaN (--nan-rank -1: none). Prints
``rank R step S loss X`` once per optimizer step (the last micro-batch's loss).
"""

import argparse
import contextlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro", type=int, default=3)
    parser.add_argument("--nan-rank", type=int, default=1)
    parser.add_argument("--nan-step", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(args.steps):
            opt.zero_grad()
            for micro in range(args.micro):
                g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
                x = torch.randn(4, 6, generator=g)
                y = torch.randint(0, 3, (4,), generator=g)
                if rank == args.nan_rank and step == args.nan_step and micro == 0:
                    x[1, 2] = float("nan")
                last = micro == args.micro - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = F.cross_entropy(model(x), y) / args.micro
                    loss.backward()
            opt.step()
            # one write per line (under PYTHONUNBUFFERED print() writes the newline apart)
            sys.stdout.write(f"rank {rank} step {step} loss {loss.item()!r}\n")
            sys.stdout.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
