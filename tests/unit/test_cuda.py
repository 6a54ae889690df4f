"""GPU-only checks (skipped without CUDA): statistics stay on the device, one sync per step."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nanhunt

pytestmark = pytest.mark.cuda


def _step(model, opt, x, y):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def test_at_most_one_device_to_host_sync_per_traced_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    _step(model, opt, x, y)  # warm up allocations outside the count
    with nanhunt.watch(model, opt) as hunt:
        _step(model, opt, x, y)  # first step: lazy hook set-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(3):
                    _step(model, opt, x, y)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 3, [str(w.message) for w in syncs]
    assert hunt.first_failure is None
    assert len(hunt.steps) == 4


def test_overflow_is_found_on_the_gpu_under_autocast():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).cuda()
    with torch.no_grad():
        model[2].weight.fill_(1e4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    with nanhunt.watch(model, opt, scaler) as hunt:
        x = torch.full((8, 16), 10.0, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    f = hunt.first_failure
    assert (f.step, f.phase, f.module, f.tensor) == (0, "forward", "2", "output")
