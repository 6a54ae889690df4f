"""The one replay contract (docs/how-it-works.md, "Replays"): a replay never changes anything
the user can observe afterwards.

Each replay kind (a culprit module on its captured inputs, an optimizer step, a kept training
step under the sentinel, the audit's tape) runs a "rogue" program that tries to change one kind
of state: it draws from a generator, edits a parameter, a buffer or a Python attribute in place,
steps optimizer or GradScaler state, switches grad mode or autocast on globally. The reference
is the same state read before the replay (or a run without nanhunt): every test fails when the
replay lets that one kind of state leak.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from nanhunt import contract
from nanhunt.capture.state import OptimizerSnapshot, Snapshot
from nanhunt.replay.module import replay
from nanhunt.replay.optimizer import replay_optimizer

KINDS = ["torch_rng", "python_rng", "numpy_rng", "params", "buffers", "module_attrs",
         "grad_mode", "autocast"]


class Rogue(nn.Module):
    """A forward that changes one kind of state the user can see (``kind``)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(4))
        self.calls = 0
        self.log: list[int] = []

    def forward(self, x):
        k = self.kind
        noise = 0.0
        if k == "torch_rng":
            noise = float(torch.rand(()))
        elif k == "python_rng":
            noise = random.random()
        elif k == "numpy_rng":
            noise = float(np.random.rand())
        elif k == "params":
            with torch.no_grad():
                self.lin.weight.add_(1.0)
        elif k == "buffers":
            self.seen.add_(1.0)
        elif k == "module_attrs":
            self.calls += 1
            self.log.append(self.calls)
        elif k == "grad_mode":
            torch.set_grad_enabled(False)  # the function form: stays switched after return
        elif k == "autocast":
            torch.set_autocast_enabled("cpu", True)
            torch.set_autocast_dtype("cpu", torch.bfloat16)
        return self.lin(x) * (1.0 + 0.0 * noise)


def observable(model: nn.Module, opt=None) -> dict:
    """Everything of the user's a replay must leave as it was."""
    np_state = np.random.get_state()
    out = {
        "torch_rng": torch.get_rng_state().clone(),
        "python_rng": random.getstate(),
        "numpy_rng": (np_state[0], np_state[1].copy(), *np_state[2:]),
        "params": [p.detach().clone() for p in model.parameters()],
        "buffers": [b.detach().clone() for b in model.buffers()],
        "module_attrs": [(m.calls, list(m.log)) for m in model.modules() if isinstance(m, Rogue)],
        "grad_mode": torch.is_grad_enabled(),
        "autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
    }
    if opt is not None:
        out["optimizer_state"] = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v
                                      for n, v in s.items()} for k, s in opt.state.items()}
    return out


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def assert_unchanged(before: dict, after: dict, kind: str) -> None:
    assert same(before[kind], after[kind]), f"the replay changed the user's {kind}"
    for k in before:  # and nothing else either
        assert same(before[k], after[k]), f"the replay changed the user's {k}"


@pytest.mark.parametrize("kind", KINDS)
def test_module_replay_leaves_the_user_state(kind):
    torch.manual_seed(0)
    model = Rogue(kind)
    x = torch.randn(2, 4)
    # the snapshot holds the user's own module here: the replay must copy it
    snap = Snapshot(module=model, name="rogue", args=(x,), kwargs={},
                    grad_outputs=[torch.ones(2, 4)], autocast=(True, torch.float16),
                    phase="backward", step=0)
    before = observable(model)
    result = replay(snap)
    assert result.error is None, result.error
    assert_unchanged(before, observable(model), kind)


class RogueSGD(torch.optim.SGD):
    """SGD whose step also changes ambient state (one kind)."""

    def __init__(self, params, kind: str):
        super().__init__(params, lr=0.1, momentum=0.9)
        self.defaults["kind"] = kind  # (kept by an optimizer's __getstate__, so by its copies)

    @torch.no_grad()
    def step(self, closure=None):
        kind = self.defaults["kind"]
        if kind == "torch_rng":
            torch.rand(())
        elif kind == "python_rng":
            random.random()
        elif kind == "numpy_rng":
            np.random.rand()
        elif kind == "grad_mode":
            torch.set_grad_enabled(False)
        elif kind == "autocast":
            torch.set_autocast_enabled("cpu", True)
        return super().step(closure)


@pytest.mark.parametrize("kind", [*KINDS, "optimizer_state"])
def test_optimizer_replay_leaves_the_user_state(kind):
    torch.manual_seed(0)
    model = Rogue("none")
    opt = RogueSGD(model.parameters(), "none")
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # momentum buffers exist: the replay must not step them
    model(torch.randn(2, 4)).sum().backward()
    opt.defaults["kind"] = kind  # rogue from now on: in the replay's copy only
    before = observable(model, opt)
    result = replay_optimizer(OptimizerSnapshot(opt, 1, "RogueSGD"))
    assert result.error is None, result.error
    assert_unchanged(before, observable(model, opt), kind)


def test_isolated_puts_back_what_the_block_changed_also_when_it_raises():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    ref = (torch.rand(()), random.random(), np.random.rand())
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    with torch.no_grad(), pytest.raises(RuntimeError), contract.isolated():
        assert torch.is_grad_enabled()  # a replay starts from grad enabled, autocast off
        assert not torch.is_autocast_enabled("cpu")
        torch.rand(5), random.random(), np.random.rand(3)
        torch.set_autocast_enabled("cpu", True)
        raise RuntimeError("a replay that fails")
    assert (torch.rand(()), random.random(), np.random.rand()) == ref
    assert not torch.is_autocast_enabled("cpu")


def test_inside_the_users_autocast_and_inference_mode_the_replay_starts_neutral():
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        with contract.isolated():
            assert not torch.is_inference_mode_enabled()
            assert not torch.is_autocast_enabled("cpu")
            y = nn.Linear(2, 2)(torch.ones(1, 2))
            assert y.dtype == torch.float32 and y.requires_grad
        assert torch.is_inference_mode_enabled() and torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_copies_are_declared_and_refused_above_the_cap():
    big = nn.Linear(256, 256)  # 257 KiB of float32
    copies = contract.Copies(cap=100_000)
    with pytest.raises(contract.CopyRefused, match=r"model \(257 KiB\).*cap of 97.7 KiB"):
        copies.module(big, "model")
    assert copies.items == []  # nothing was copied
    ok = contract.Copies(cap=1_000_000)
    dup = ok.module(big, "model")
    assert dup is not big and torch.equal(dup.weight, big.weight)
    assert ok.items == [("model", (256 * 256 + 256) * 4)]
    assert "model 257 KiB" in ok.describe()


def test_module_replay_above_the_cap_is_refused_with_a_message(monkeypatch):
    monkeypatch.setenv("NANHUNT_REPLAY_MAX_BYTES", "1000")
    snap = Snapshot(module=nn.Linear(64, 64), name="fc", args=(torch.randn(2, 64),),
                    kwargs={}, grad_outputs=None, autocast=(False, None), phase="forward",
                    step=0)
    result = replay(snap)
    assert result.error is not None and "more than the cap" in result.error
    assert result.ops == []


@pytest.mark.parametrize("kind", KINDS)
def test_the_audit_tape_leaves_the_user_state(kind):
    import nanhunt

    torch.manual_seed(0)
    model = Rogue(kind)
    g = torch.Generator().manual_seed(0)
    batches = iter([(torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g))
                    for _ in range(2)])
    before = observable(model)
    trace = nanhunt.audit(model, lambda: next(batches), lambda out, y: (out - y).pow(2).mean(),
                          steps=2, target="bfloat16")
    assert trace.precision is not None  # the tape was replayed in float32 and the target
    assert_unchanged(before, observable(model), kind)
