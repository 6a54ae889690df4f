"""One naming rule: the names a report prints (capture) are the names a ``--fix`` pattern
matches (the fix installer), for a model with a lazy module, a module created after its root
was named, and a second root."""

from __future__ import annotations

import torch
from torch import nn

import nanhunt
from nanhunt.experiment.fixes import install
from nanhunt.fixspec import parse_fix


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.LazyLinear(8), nn.ReLU())
        self.extra: nn.Module | None = None

    def forward(self, x):
        if self.extra is None:  # created on the first call, after the root was named
            self.extra = nn.Linear(8, 8)
        return self.extra(self.body(x))


def _steps(n: int = 2) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model, critic = Net(), nn.Linear(8, 1)
    for _ in range(n):
        loss = critic(model(torch.randn(4, 3))).pow(2).mean()
        loss.backward()
    return model, critic


def test_the_fix_installer_names_modules_as_capture_does():
    torch.manual_seed(0)
    with nanhunt.watch() as hunt:
        _steps()
    captured = {layer.module for layer in hunt.trace().layers}
    # a pattern that matches everything, installed the way `--fix` installs it
    fixes = install([parse_fix("fp32:*")])
    try:
        _steps()
    finally:
        fixes.uninstall(completed=False)
    named = set(fixes._names.all)
    assert {"body.0", "extra", "critic"} <= captured
    assert captured <= named
