"""Tensor parallelism (parallelize_module: ColwiseParallel, RowwiseParallel) on CPU with gloo, 2
ranks under torchrun, float16 autocast.

    torchrun --standalone --nproc-per-node 2 tp_overflow.py [--plant]

Both ranks hold one shard of each linear layer's weights (DTensors) and see the same batch.
With --plant, the ``boost`` layer multiplies its input by float16's max at step 2: its output
overflows on every rank. Prints ``rank R step S loss X gnorm G``: the whole model's gradient
norm from the full (unsharded) gradients, computed by torch (``full_tensor()``).
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Boost(nn.Module):
    def __init__(self):
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return x * self.factor


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--plant", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Boost(), nn.Linear(16, 4))
        model = parallelize_module(model, mesh, {"0": ColwiseParallel(),
                                                 "3": RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(args.steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4, 8, generator=g)
            y = torch.randn(4, 4, generator=g)
            model[2].factor = torch.finfo(torch.float16).max \
                if args.plant and step == 2 else 1.0
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            opt.zero_grad()
            loss.backward()
            gnorm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad.full_tensor(), dtype=torch.float64)
                 for p in model.parameters()]))
            opt.step()
            sys.stdout.write(f"rank {rank} step {step} loss {loss.item()} "
                             f"gnorm {gnorm.item()}\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
