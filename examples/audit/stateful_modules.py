"""A model whose modules keep state across calls: the audit's replays must leave all of it alone.

Trains under torch.autocast("cpu", float16) + GradScaler. Besides BatchNorm in train mode
(running statistics) and dropout (torch's generator), its modules keep Python state that a
replay of their forward would change: a call counter that the output depends on, a registered
buffer updated in place in forward, a plain tensor attribute updated in place, a list that
grows every call, a cached tensor, and a coin flip from Python's ``random``. The script prints
each loss and, at the end, a digest of every parameter, buffer and piece of that state and of
the generators: ``nanhunt audit`` on it must print exactly what the script prints alone.

    python examples/audit/stateful_modules.py [--arch mlp|cnn] [--steps N]
    nanhunt audit examples/audit/stateful_modules.py
"""

from __future__ import annotations

import argparse
import hashlib
import random

import torch
import torch.nn as nn
import torch.nn.functional as F


class Counter(nn.Module):
    """Counts its calls; the output depends on the count (a schedule kept in the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * (1.0 + 0.01 * (self.calls % 3))


class Ema(nn.Module):
    """A registered buffer and a plain tensor attribute, both updated in place in forward."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(d))
        self.gain = torch.ones(1)  # not a buffer: plain Python state
        self.history: list[float] = []
        self.last: torch.Tensor | None = None

    def forward(self, x):
        dims = [0, *range(2, x.dim())]
        self.running.mul_(0.9).add_(x.detach().float().mean(dims), alpha=0.1)
        self.gain.mul_(1.001)
        self.history.append(float(x.detach().float().mean()))
        self.last = x.detach()
        shape = [1, -1] + [1] * (x.dim() - 2)
        out = (x - self.running.view(shape).to(x.dtype)) * self.gain.to(x.dtype)
        return out + 1e-3 * len(self.history)


class Coin(nn.Module):
    """Stochastic depth written with Python's random module."""

    def forward(self, x):
        return x * 1.5 if random.random() < 0.5 else x


def build(arch: str) -> nn.Module:
    if arch == "cnn":
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), Counter(),
                             nn.ReLU(), Ema(8), Coin(), nn.Dropout(0.2),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), Counter(), nn.GELU(), Ema(32),
                         Coin(), nn.Dropout(0.2), nn.Linear(32, 4))


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in list(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for m in model.modules():
        if isinstance(m, Counter):
            h.update(str(m.calls).encode())
        if isinstance(m, Ema):
            last = None if m.last is None else m.last.sum().item()
            h.update(repr((m.gain.item(), m.history, last)).encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    random.seed(0)
    model = build(args.arch)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x = torch.randn(16, 3, 8, 8) if args.arch == "cnn" else torch.randn(16, 16)
        y = torch.randint(0, 4, (16,))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item()!r}")
    print(f"state {digest(model)}")


if __name__ == "__main__":
    main()
