"""The audit's live session (what ``nanhunt audit`` and the callbacks run): a run that ends
before its steps is ranked on the steps it had; a paused session records nothing."""

from __future__ import annotations

import math
from types import MethodType

import pytest
import torch
from torch import nn

from nanhunt.precision import AuditSession, attach
from nanhunt.trace import RunInfo, Trace


class Shift(nn.Module):
    def forward(self, x):
        return (x + 1024.0) - 1024.0


def _train(steps: int, session: AuditSession, pause_every_other: bool = False) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Shift(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        if pause_every_other:
            (session.pause if i % 2 else session.resume)()
        x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()


def test_a_run_shorter_than_the_audit_is_ranked_on_what_it_had():
    session = AuditSession(steps=10, warmup=1, label="model")
    with session:
        _train(3, session)
    assert session.audit is not None and session.audit.steps == 2
    trace = attach(Trace(run=RunInfo()), session)
    assert [x.module for x in trace.precision.layers if x.rank == 1] == ["1"]
    assert "the audit measured 2 of the 10 steps asked for: the run ended first" in trace.notes


def test_paused_steps_are_neither_counted_nor_audited():
    session = AuditSession(steps=10, warmup=1, label="model")
    with session:
        _train(6, session, pause_every_other=True)  # steps 0, 2, 4 run; 1, 3, 5 paused
    assert session._backwards == 3 and session.audit.steps == 2


class TiedGPT(nn.Module):
    """nanoGPT / GPT-2 style: the output projection shares the embedding's weight."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.h = nn.Linear(dim, dim)
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(self.ln_f(torch.relu(self.h(self.wte(idx)))))


def test_tied_weights_are_audited():
    torch.manual_seed(0)
    model = TiedGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = AuditSession(steps=2, warmup=1, label="model")
    with session:
        for _ in range(3):
            idx = torch.randint(0, 32, (4, 8))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(idx)
            loss = nn.functional.cross_entropy(out.float().view(-1, 32), idx.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert session.auditor.notes == []
    audit = session.audit
    assert audit is not None and audit.steps == 2
    assert (audit.target, audit.mode) == ("bfloat16", "measured")
    assert {"wte", "lm_head"} <= {x.module for x in audit.layers}
    assert model.lm_head.weight is model.wte.weight  # still tied


def _wrapped_in_autocast(model: nn.Module) -> nn.Module:
    # what accelerate's prepare() does for --bf16 (transformers' Trainer): the forward itself
    # runs under autocast, so the model's call is made with autocast off
    model.forward = MethodType(torch.autocast("cpu", dtype=torch.bfloat16)(
        type(model).forward), model)
    return model


def test_a_forward_wrapped_in_bf16_autocast_is_audited_in_bfloat16_against_real_float32():
    torch.manual_seed(0)
    model = _wrapped_in_autocast(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)))
    batches = [(torch.randn(16, 8) * 3, torch.randint(0, 4, (16,))) for _ in range(3)]
    session = AuditSession(steps=2, warmup=1, label="model")
    run_losses = []
    with session:
        for x, y in batches:  # no optimizer: the weights stay those of the references below
            loss = nn.functional.cross_entropy(model(x).float(), y)
            run_losses.append(loss.item())
            loss.backward()
            model.zero_grad()
    audit = session.audit
    assert audit is not None and session.auditor.notes == []
    assert (audit.target, audit.mode) == ("bfloat16", "measured")
    assert audit.reproduced is True
    with torch.no_grad():  # float32 by hand: the class's own forward, no autocast anywhere
        refs = [nn.functional.cross_entropy(type(model).forward(model, x), y).item()
                for x, y in batches[1:]]
    got = [(p.target, p.float32) for p in audit.loss_by_step]
    assert [t for t, _ in got] == pytest.approx(run_losses[1:], rel=1e-6)
    assert [f for _, f in got] == pytest.approx(refs, rel=1e-6)
    assert all(t != f for t, f in got)  # bf16 against float32: not "exact"
    assert all(math.isfinite(x.sqnr_db) for x in audit.layers if x.module in ("0", "2"))


def test_a_simulated_target_is_computed_in_the_target_inside_a_wrapped_forward():
    """--target float16 on a run whose forward enters bf16 autocast itself: the float16 replay
    computes in float16 (the forward's own autocast follows the target), against a float16
    autocast run of the class's own forward by hand."""
    torch.manual_seed(0)
    model = _wrapped_in_autocast(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)))
    batches = [(torch.randn(16, 8) * 3, torch.randint(0, 4, (16,))) for _ in range(2)]
    session = AuditSession(["float16"], steps=1, warmup=1, label="model")
    with session:
        for x, y in batches:
            nn.functional.cross_entropy(model(x).float(), y).backward()
            model.zero_grad()
    audit = session.audit
    assert audit is not None and (audit.target, audit.mode) == ("float16", "simulated")
    x, y = batches[1]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        want = nn.functional.cross_entropy(type(model).forward(model, x).float(), y).item()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = nn.functional.cross_entropy(type(model).forward(model, x).float(), y).item()
    assert want != bf16
    assert audit.loss_by_step[0].target == pytest.approx(want, rel=1e-6)
