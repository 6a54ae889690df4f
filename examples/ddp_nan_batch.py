"""Fails on one rank: DDP (gloo, CPU), and rank 1's batch of step 2 holds a NaN.

Run it with two processes (each one reads torchrun's RANK / WORLD_SIZE / MASTER_ADDR):

    nanhunt diagnose --nproc-per-node 2 examples/ddp_nan_batch.py
    torchrun --standalone --nproc-per-node 2 -m nanhunt diagnose examples/ddp_nan_batch.py

Expected merged report:
  origin rank 1: step 2 (0-based), phase data, the model's input[0] (sample 5, feature 2 is NaN).
  Rank 0's own batches are finite: before the gradient all-reduce it sees nothing non-finite in
  step 2 (DDP then averages rank 1's NaN gradients into every rank's, and GradScaler skips the
  step on both). Both ranks stop after step 2.
Options: --nan-rank R / --nan-step S move the corrupt record (--nan-rank -1: none);
--raise-rank R / --raise-step S make rank R raise a RuntimeError at the start of step S (the
report names the rank that raised, and no rank hangs).
Fix: clean/validate rank 1's data shard (assert torch.isfinite(x).all() in the loader).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self, d_in=12, d_hidden=32, n_classes=3):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_hidden), nn.ReLU()
        )
        self.head = nn.Linear(d_hidden, n_classes)

    def forward(self, x):
        return self.head(self.body(x))


def make_batch(rank, step, batch_size=8, d_in=12):
    """Each rank reads its own shard: the generator is seeded by rank and step."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(batch_size, d_in, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return x, y.clamp(max=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--nan-rank", type=int, default=1)
    parser.add_argument("--nan-step", type=int, default=2)
    parser.add_argument("--raise-rank", type=int, default=-1)
    parser.add_argument("--raise-step", type=int, default=1)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # env:// from torchrun
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)
        model = DDP(Net())
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu")
        for step in range(args.steps):
            if rank == args.raise_rank and step == args.raise_step:
                raise RuntimeError(f"rank {rank}: planted failure at step {step}")
            x, y = make_batch(rank, step)
            if rank == args.nan_rank and step == args.nan_step:
                x[5, 2] = float("nan")  # a corrupt record in this rank's shard
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            print(f"rank {rank} step {step} loss {loss.item():.4f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
