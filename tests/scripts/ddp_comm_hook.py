"""DDP with fp16_compress_hook (gloo, CPU, 2 ranks under torchrun): at step 2 the gradients are
finite in float32 on each rank but exceed float16's max, so the compressed all-reduce makes
them inf. --hook none is the fix (and the healthy twin); --hook bf16 is the other fix where DDP
accepts bf16_compress_hook (CUDA 11+ with NCCL 2.10+, or XPU). Prints ``rank R step S loss X``.
Under plain ``python`` (no torchrun) it trains as one rank: the compression still casts."""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", choices=["fp16", "bf16", "none"], default="fp16")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if "RANK" not in os.environ:  # python ddp_comm_hook.py: a one-process group
        init = f"file://{tempfile.mkdtemp()}/store"
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
        if args.hook != "none":
            hook = default_hooks.fp16_compress_hook if args.hook == "fp16" else \
                default_hooks.bf16_compress_hook
            model.register_comm_hook(None, hook)
        opt = torch.optim.SGD(model.parameters(), lr=1e-9)
        for step in range(args.steps):
            g = torch.Generator().manual_seed(10 * rank + step)
            x = torch.randn(16, 4, generator=g)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            # step 2: the loop scales its gradients by hand (a fixed loss scale) far beyond
            # 65504; finite in float32, the loss itself unchanged
            loss.backward(torch.tensor(2e6) if step == 2 else None)
            opt.step()
            # one write per line (under PYTHONUNBUFFERED print() writes the newline apart)
            sys.stdout.write(f"rank {rank} step {step} loss {loss.item()!r}\n")
            sys.stdout.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
