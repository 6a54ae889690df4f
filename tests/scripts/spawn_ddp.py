"""DDP whose workers the script starts itself (``torch.multiprocessing``), gloo on CPU, 2 ranks.

    python spawn_ddp.py                      # mp.spawn; rank 1's batch of step 2 holds a NaN
    python spawn_ddp.py --nan-rank -1        # the healthy twin
    python spawn_ddp.py --start-method fork  # torch.multiprocessing.start_processes(fork)
    python spawn_ddp.py --raise-rank 1       # rank 1 raises at step 1

Each worker prints ``rank R step S loss X`` (X with every digit); after the workers are done
the parent prints ``done``. Without nanhunt the NaN spreads to both ranks through the gradient
all-reduce and every later loss is nan.
"""

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.body(x))


def worker(rank, world, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = DDP(Net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(args.steps):
            if rank == args.raise_rank and step == 1:
                raise RuntimeError(f"rank {rank}: planted failure at step {step}")
            g = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(4, 6, generator=g)
            y = torch.randint(0, 3, (4,), generator=g)
            if rank == args.nan_rank and step == args.nan_step:
                x[1, 2] = float("nan")  # a corrupt record in this rank's shard
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            # one write a line: print writes the text and the newline apart, and two workers
            # share the pipe
            sys.stdout.write(f"rank {rank} step {step} loss {loss.item()!r}\n")
            sys.stdout.flush()
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--nan-rank", type=int, default=1)
    parser.add_argument("--nan-step", type=int, default=2)
    parser.add_argument("--raise-rank", type=int, default=-1)
    parser.add_argument("--start-method", choices=["spawn", "fork"], default="spawn")
    args = parser.parse_args()
    world = 2
    if args.start_method == "spawn":
        mp.spawn(worker, args=(world, free_port(), args), nprocs=world, join=True)
    else:
        mp.start_processes(worker, args=(world, free_port(), args), nprocs=world, join=True,
                           start_method="fork")
    print("done", flush=True)


if __name__ == "__main__":
    main()
