"""Step boundaries that frameworks rely on, the automatic target format, and the per-step
module statistics behind the TensorBoard export, against independent references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import nanhunt


def _lbfgs_run(watch: bool, steps: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    x, y = torch.randn(16, 6), torch.randn(16, 1)
    first_losses, calls = [], []

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        calls.append(loss.item())
        return loss

    hunt = nanhunt.Hunt(model, opt) if watch else None
    if hunt:
        hunt.start()
    try:
        for _ in range(steps):
            n = len(calls)
            returned = opt.step(closure)  # positional closure, as LBFGS's docs write it
            first_losses.append(calls[n])
            assert returned.item() == calls[n]  # step() returns the closure's first loss
    finally:
        if hunt:
            hunt.stop()
    return model, hunt, first_losses, calls


def test_lbfgs_positional_closure_is_one_step_per_optimizer_step():
    model, hunt, first_losses, calls = _lbfgs_run(watch=True)
    assert len(calls) > 4  # the closure ran several times a step
    assert [s.index for s in hunt.steps] == [0, 1, 2, 3]
    # the gradient norm is the first evaluation's (the one step() starts from)
    assert all(s.grad_norm is not None and math.isfinite(s.grad_norm) for s in hunt.steps)
    plain, _, plain_losses, _ = _lbfgs_run(watch=False)
    assert first_losses == plain_losses  # the closure's results are untouched
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)  # bit-identical training


@pytest.mark.parametrize("arch", ["mlp", "conv"])
def test_nan_in_an_earlier_micro_batch_is_the_steps_problem(arch):
    torch.manual_seed(0)
    if arch == "conv":
        model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 1))
        shape = (4, 2, 6)
    else:
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
        shape = (4, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanhunt.watch(model, opt) as hunt:
        for step in range(3):
            for micro in range(2):
                x = torch.randn(*shape)
                if step == 1 and micro == 0:
                    x.view(-1)[5] = float("nan")  # the first of two micro-batches
                (model(x).pow(2).mean() / 2).backward()
            opt.step()
            opt.zero_grad()
    f = hunt.first_failure
    assert (f.step, f.phase) == (1, "data")
    assert [s.index for s in hunt.steps] == [0, 1, 2]
    assert math.isnan(hunt.steps[1].loss)  # the last micro-batch's loss was finite


def _one_step(model: nn.Module, x: torch.Tensor, autocast: torch.dtype | None = None, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanhunt.watch(model, opt, **kw) as hunt:
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
    return hunt.trace()


@pytest.mark.parametrize(("autocast", "params", "target", "source"), [
    (torch.bfloat16, torch.float32, "bfloat16", "autocast"),
    (torch.float16, torch.float32, "float16", "autocast"),
    (None, torch.bfloat16, "bfloat16", "parameters"),
    (None, torch.float16, "float16", "parameters"),
    (None, torch.float32, "float16", "default"),
])
def test_automatic_target(autocast, params, target, source):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).to(params)
    trace = _one_step(model, torch.randn(3, 4, dtype=params), autocast)
    assert (trace.run.target, trace.run.target_source) == (target, source)


def test_a_half_submodule_makes_the_target_float16():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2).half()

        def forward(self, x):
            return self.head(self.body(x).half())

    trace = _one_step(Net(), torch.randn(3, 4))
    assert (trace.run.target, trace.run.target_source) == ("float16", "parameters")


def test_an_explicit_target_wins():
    model = nn.Linear(4, 2)
    trace = _one_step(model, torch.randn(3, 4), torch.bfloat16, target="float8_e4m3fn")
    assert (trace.run.target, trace.run.target_source) == ("float8_e4m3fn", "option")


def test_first_step_numbers_steps_like_the_framework():
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt, first_step=40) as hunt:
        for _ in range(2):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
    assert [s.index for s in hunt.steps] == [40, 41]


def test_layer_steps_match_numpy_binades():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    h = model[0].register_forward_hook(lambda m, a, o: outputs.append(o.detach().clone()))
    try:
        with nanhunt.watch(model, opt, target="float16") as hunt:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(6, 5) * 1e-3).sum().backward()
                opt.step()
    finally:
        h.remove()
    trace = hunt.trace()
    got = {(ls.module, ls.step): ls for ls in trace.layer_steps}
    for step, out in enumerate(outputs):
        ls = got[("0", step)]
        a = np.abs(out.numpy().astype(np.float64)).ravel()
        a = a[a > 0]
        ref = dict(zip(*np.unique(np.floor(np.log2(a)).astype(int), return_counts=True)))
        assert ls.forward.hist == {int(k): int(v) for k, v in ref.items()}
        under = int((a < 2.0**-14).sum())
        assert ls.forward.underflow_fraction == pytest.approx(under / a.size)
        assert ls.forward.amax == pytest.approx(a.max())
        assert ls.backward is not None  # the gradient w.r.t. its output


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_without_an_optimizer_evaluation_batches_are_no_steps(mode):
    """word_language_model's shape: a hand-written SGD update, a loss module, and an evaluation
    pass (the model and the loss module under no_grad) after every few training batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    criterion = nn.CrossEntropyLoss()
    trained = 0
    session = nanhunt.Hunt() if mode == "full" else nanhunt.sentinel(out=None)
    with session as hunt:
        for _epoch in range(2):
            for _ in range(4):
                x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
                model.zero_grad()
                criterion(model(x), y).backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(p.grad, alpha=-0.1)
                trained += 1
            model.eval()
            with torch.no_grad():
                for _ in range(3):
                    criterion(model(torch.randn(5, 6)), torch.randint(0, 3, (5,)))
            model.train()
    assert trained == 8
    assert [s.index for s in hunt.steps] == list(range(trained))
    assert all(s.loss is not None for s in hunt.steps)


def test_the_scripts_gradscaler_settings_are_recorded():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**9,
                                  backoff_factor=0.25)
    with nanhunt.watch() as hunt:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert hunt.trace().run.scaler_settings == {
        "init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.25,
        "growth_interval": 10**9}
