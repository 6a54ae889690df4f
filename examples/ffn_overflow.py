"""Fails: encoder.blocks.1.ffn.wo output overflows fp16 (> 65504) at step 3 (data in other units).

Expected first non-finite value:
  step 3 (0-based), phase forward, module "encoder.blocks.1.ffn.wo" (nn.Linear), tensor "output"
  (+/-inf from fp16 overflow, ~130 of 1024 values; NaN follows downstream in the same step).
Steps 0-2 are finite everywhere (amax of that output ~1.9e4), and at step 3 every module that runs
before it (encoder.input_proj, encoder.blocks.0.*, encoder.blocks.1.ffn.wi / .act, amax <= 2.6e4)
is still finite.  Cause: from step 3 on the data shard is in other units (features x10), amplified
by encoder weights initialised with std 1.0 (nn.init.normal_).  GradScaler skips steps 3.. and
halves the scale each time; the loss prints nan from step 3 on.
Fix: run encoder.blocks.1.ffn.wo in fp32 (checked: then all default steps are finite), or
normalise the inputs / use a sane init.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


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
    x = 0.5 * torch.randn(batch_size, d_in)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    units = 10.0 if step >= 3 else 1.0  # from step 3 on, a data shard recorded in other units
    return x * units, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    model = Model()
    model.encoder.apply(init_weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cpu")

    for step in range(args.steps):
        x, y = make_batch(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
