"""A loop with a hand-written learning-rate schedule that sets absolute values before every
step (as karpathy/nanoGPT's train.py does: ``param_group['lr'] = get_lr(iter_num)``), so a
factor applied once to the optimizer's lr when it is made would be overwritten.

--scale F multiplies the schedule's values by F: the change a user makes by hand for
``--fix lr-factor=F``. Prints ``step N loss L lr R`` (repr, to compare runs bit for bit).
"""

import argparse
import math

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--scale", type=float, default=1.0)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
x, y = torch.randn(64, 8), torch.randn(64, 1)


def get_lr(it):
    warmup, total, top = 2, args.steps, 3e-2
    if it < warmup:
        return top * (it + 1) / (warmup + 1)
    return 0.5 * top * (1 + math.cos(math.pi * (it - warmup) / (total - warmup)))


for it in range(args.steps):
    lr = get_lr(it) * args.scale
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    print(f"step {it} loss {loss.item()!r} lr {optimizer.param_groups[0]['lr']!r}")
