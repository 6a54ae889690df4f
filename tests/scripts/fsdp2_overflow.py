"""FSDP2 (fully_shard with a MixedPrecisionPolicy) on CPU with gloo, 2 ranks under torchrun.

    torchrun --standalone --nproc-per-node 2 fsdp2_overflow.py --param-dtype float16
    torchrun --standalone --nproc-per-node 2 fsdp2_overflow.py --param-dtype bfloat16 --plant

With --plant, rank 1's ``boost`` layer multiplies its input by the format's max at step 2: its
output overflows (the layer before it, ``0``, and every other rank stay finite). With
``--sentinel OUT`` the loop runs under ``nanhunt.sentinel(model, opt, out=OUT)``. Prints
``rank R step S loss X gnorm G amax0 A``: the whole model's gradient norm and the largest
|gradient| of layer ``0``'s parameters, computed by torch from the full (unsharded) gradients.
"""

import argparse
import contextlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Boost(nn.Module):
    def __init__(self):
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return x * self.factor


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--param-dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--plant", action="store_true")
    parser.add_argument("--sentinel", metavar="OUT")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dtype = getattr(torch, args.param_dtype)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Boost(), nn.Linear(16, 4))
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in (model[0], model[3]):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        watching = contextlib.nullcontext()
        if args.sentinel:
            import nanhunt

            watching = nanhunt.sentinel(model, opt, out=args.sentinel)
        with watching:
            train(args, model, opt, rank, dtype)
    finally:
        dist.destroy_process_group()


def train(args, model, opt, rank, dtype):
    for step in range(args.steps):
        g = torch.Generator().manual_seed(10 * rank + step)
        x = torch.randn(4, 8, generator=g)
        y = torch.randn(4, 4, generator=g)
        model[2].factor = torch.finfo(dtype).max if args.plant and rank == 1 and step == 2 \
            else 1.0
        loss = F.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        gnorm = torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))
        amax0 = max(p.grad.full_tensor().abs().max().item() for p in model[0].parameters())
        opt.step()
        # one write per line: under PYTHONUNBUFFERED print() writes the text and its
        # newline apart, and the two ranks' lines would interleave on the shared pipe
        sys.stdout.write(f"rank {rank} step {step} loss {loss.item()!r} gnorm "
                         f"{gnorm.item()!r} amax0 {amax0!r}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
