"""Fails on every rank alike: DDP (gloo, CPU), fp16 overflow in encoder.blocks.1.ffn.wo, step 3.

Run it with two processes:

    nanhunt diagnose --nproc-per-node 2 examples/ddp_overflow.py
    torchrun --standalone --nproc-per-node 2 -m nanhunt diagnose examples/ddp_overflow.py

The model and cause are those of ffn_overflow.py: encoder weights initialised with std 1.0, and
from step 3 on the data arrive in other units (features x10). Every rank reads the same stream
here, so every rank overflows at the same place.
Expected merged report: the first failure at step 3, phase forward, module
"encoder.blocks.1.ffn.wo", tensor "output" (+/-inf from fp16 overflow), on every rank ("every rank
failed alike"): a model/precision problem, not one rank's bad shard.
Fix: run encoder.blocks.1.ffn.wo in fp32, or normalise the inputs / use a sane init.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class FFN(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.wi = nn.Linear(d, hidden)
        self.act = nn.ReLU()
        self.wo = nn.Linear(hidden, d)

    def forward(self, x):
        return self.wo(self.act(self.wi(x)))


class Block(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.ffn = FFN(d, hidden)

    def forward(self, x):
        return x + self.ffn(x)


class Encoder(nn.Module):
    def __init__(self, d_in=16, d=32, hidden=128, n_blocks=2):
        super().__init__()
        self.input_proj = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList([Block(d, hidden) for _ in range(n_blocks)])

    def forward(self, x):
        x = self.input_proj(x)
        for block in self.blocks:
            x = block(x)
        return x


class Model(nn.Module):
    def __init__(self, n_classes=4):
        super().__init__()
        self.encoder = Encoder()
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, n_classes)

    def forward(self, x):
        return self.head(self.norm(self.encoder(x)))


def init_weights(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight)  # std 1.0: a common mistake
        nn.init.zeros_(m.bias)


def make_batch(step, batch_size=32, d_in=16):
    g = torch.Generator().manual_seed(step)  # the same stream on every rank
    x = 0.5 * torch.randn(batch_size, d_in, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    units = 10.0 if step >= 3 else 1.0  # from step 3 on, data recorded in other units
    return x * units, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # env:// from torchrun
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)
        model = Model()
        model.encoder.apply(init_weights)
        model = DDP(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        scaler = torch.amp.GradScaler("cpu")
        for step in range(args.steps):
            x, y = make_batch(step)
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
