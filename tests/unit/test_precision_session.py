"""The audit's live session (what ``nanhunt audit`` and the callbacks run): a run that ends
before its steps is ranked on the steps it had; a paused session records nothing."""

from __future__ import annotations

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
