"""FSDP1 (FullyShardedDataParallel with MixedPrecision) on CPU with gloo, 2 ranks under torchrun.

    torchrun --standalone --nproc-per-node 2 fsdp1_overflow.py [--plant] [--flat] [--nested]

The model's float16 MixedPrecision casts its weights for the forward and backward and reduces
the gradients in float32. ``--nested`` wraps layer ``3`` in an FSDP unit of its own (same
policy); ``--flat`` keeps FSDP1's default flat parameters (``use_orig_params=False``). With
--plant, rank 1's ``boost`` layer multiplies its input by float16's max at step 2: its output
overflows (the layer before it, ``0``, and every other rank stay finite). Prints
``rank R step S loss X gnorm G``: the whole model's gradient norm, from each rank's gradient
shards' sums of squares added up across the ranks by an all-reduce of the script's own.
``--fp32-unit NAME`` wraps that module in a float32 unit of its own, written by hand (its
output cast back to float16 for the layers after it).
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision


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
    parser.add_argument("--flat", action="store_true")
    parser.add_argument("--nested", action="store_true")
    parser.add_argument("--fp32-unit", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Boost(), nn.Linear(16, 4))
        policy = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
        cpu = torch.device("cpu")
        if args.fp32_unit is not None:
            fp32 = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                  cast_forward_inputs=True)
            inner = FSDP(model.get_submodule(args.fp32_unit), device_id=cpu,
                         use_orig_params=not args.flat, mixed_precision=fp32)
            inner.register_forward_hook(lambda m, a, out: out.half())
            model[int(args.fp32_unit)] = inner
        if args.nested:
            model[3] = FSDP(model[3], device_id=cpu, use_orig_params=not args.flat,
                            mixed_precision=policy)
        model = FSDP(model, device_id=cpu, use_orig_params=not args.flat,
                     mixed_precision=policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(args.steps):
            g = torch.Generator().manual_seed(10 * rank + step)
            x = torch.randn(4, 8, generator=g)
            y = torch.randn(4, 4, generator=g)
            model.module[2].factor = torch.finfo(torch.float16).max \
                if args.plant and rank == 1 and step == 2 else 1.0
            loss = F.mse_loss(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            sumsq = torch.zeros((), dtype=torch.float64)
            for p in model.parameters():
                if p.grad is not None:
                    sumsq += p.grad.double().pow(2).sum()
            dist.all_reduce(sumsq)
            opt.step()
            sys.stdout.write(f"rank {rank} step {step} loss {loss.item()} "
                             f"gnorm {sumsq.sqrt().item()}\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
