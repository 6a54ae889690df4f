"""A training loop written for accelerate with ``mixed_precision="fp16"``: ``accelerator.prepare``,
``accelerator.autocast`` through the prepared model, ``accelerator.backward`` (which scales the
loss), ``accelerator.clip_grad_norm_`` (which unscales) and the prepared optimizer's step (which
steps through GradScaler and skips a step whose gradients overflowed).

On a GPU accelerate makes that GradScaler itself. On CPU it makes none (its fp16 mode needs a
GPU), so ``--cpu-scaler`` (the default) gives the Accelerator, before ``prepare``, the objects it
would make on CUDA: a ``torch.amp.GradScaler("cpu")`` and native AMP (float16 autocast on the
prepared model's forward). Everything after that is accelerate's own code.

``--plant STEP``: at that step the second layer's weights are multiplied by 1e5, so its float16
output overflows in the forward. Prints ``step S loss X scale K``.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--plant", type=int, default=None)
    parser.add_argument("--no-cpu-scaler", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    if not args.no_cpu_scaler and accelerator.scaler is None:
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        accelerator.native_amp = True
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x = torch.randn(32, 16, generator=g)
        y = torch.randint(0, 4, (32,), generator=g)
        if step == args.plant:
            with torch.no_grad():
                model[2].weight.mul_(1e5)
        with accelerator.autocast():
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scale = accelerator.scaler.get_scale() if accelerator.scaler is not None else None
        print(f"step {step} loss {loss.item()!r} scale {scale}")


if __name__ == "__main__":
    main()
