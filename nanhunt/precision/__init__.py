"""The precision audit: which layers lose accuracy in FP16, BF16 or FP8 before anything is NaN.

``nanhunt audit train.py`` (see docs/cli.md) and :func:`audit` (the library form) measure, for
every module call of a few steps, how far the module's output in the target format is from
float32: alone on the same inputs (``sqnr_db``), against a float32 run of the whole model on the
same batch (``sqnr_db_end_to_end``) and for the gradient of its output (``grad_sqnr_db``); rank
the layers; and advise float32 for the few that lose far more than the rest, checked by
replaying the step with the advice applied. Results land in ``Trace.precision``.

>>> import torch, nanhunt
>>> from torch import nn
>>> class Shift(nn.Module):            # (x + c) - c: cancellation in float16
...     def forward(self, x):
...         return (x + 1024.0) - 1024.0
>>> model = nn.Sequential(nn.Linear(8, 8), Shift(), nn.Linear(8, 2)).half()
>>> batches = lambda: (torch.randn(4, 8).half(), torch.randint(0, 2, (4,)))
>>> loss_fn = lambda out, y: nn.functional.cross_entropy(out.float(), y)
>>> trace = nanhunt.audit(model, batches, loss_fn, steps=1)
>>> [layer.module for layer in trace.precision.layers if layer.rank == 1]
['1']
"""

from __future__ import annotations

import datetime as _dt
import platform
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanhunt._version import __version__
from nanhunt.errors import NanhuntError
from nanhunt.trace import RunInfo, Trace, host_platform

if TYPE_CHECKING:
    import torch
    from torch import nn

    from nanhunt.precision._session import AuditSession

__all__ = ["AuditSession", "attach", "audit", "build_trace", "parse_targets"]


def __getattr__(name: str) -> Any:
    # torch is imported on first use: `nanhunt audit --help` and usage errors stay torch-free
    if name == "AuditSession":
        from nanhunt.precision._session import AuditSession

        return AuditSession
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_trace(session: AuditSession, run: RunInfo) -> Trace:
    """The report of a finished session: ``precision`` plus the checked fp32 advice."""
    trace = Trace(run=run)
    attach(trace, session)
    if session.audit is not None:
        run.target = session.audit.target
    dtypes = {s.plan.fmt.name for s in session.auditor.states if s.plan and s.plan.measured}
    run.dtypes = sorted(dtypes | {"float32"})
    return trace


def attach(trace: Trace, session: AuditSession) -> Trace:
    """Put a finished session's ``precision``, advice and notes into ``trace`` (the audit's
    own report, or a framework callback's diagnosis report)."""
    audit_ = session.audit
    trace.precision = audit_
    trace.recommendations = [*trace.recommendations, *session.recommendations]
    if audit_ is not None:
        audit_.seconds_plain_step = session.plain_step_seconds()
        for other in audit_.compare:
            other.seconds_plain_step = audit_.seconds_plain_step
        if audit_.steps < session.steps:
            trace.notes.append(f"the audit measured {audit_.steps} of the {session.steps} "
                               "steps asked for: the run ended first")
    else:
        trace.notes.append(
            "nothing was audited: no backward() on a value the model computed was seen after "
            f"the {session.warmup} warm-up step(s)" if not session.auditor.notes else
            session.auditor.notes[0])
    trace.notes += [n for n in session.auditor.notes if n not in trace.notes]
    return trace


def audit(
    model: nn.Module,
    batch_fn: Callable[[], Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    target: str | list[str] | None = None,
    steps: int = 3,
    out: str | Path | None = None,
) -> Trace:
    """Audit ``model`` on ``steps`` batches: ``batch_fn()`` returns ``(inputs, targets)`` and
    the loss is ``loss_fn(model(inputs), targets)`` (``inputs`` a tuple: ``model(*inputs)``).

    The model runs as given (a ``.half()`` model is measured in float16); ``target`` (a format
    or several, default the model's low-precision dtype, else float16) is simulated otherwise.
    Nothing is trained, and everything the audit's own calls could change is put back: the
    model's parameters, buffers, gradients and other Python attributes (a call counter, a
    cache), and torch's, Python's and numpy's random generators (``batch_fn``'s draws included).
    With ``out``, report.json / report.html / report.txt are written there. Returns the trace;
    ``trace.precision`` holds the layers and ``trace.recommendations`` the checked advice.
    """
    import torch

    from nanhunt.contract import isolated
    from nanhunt.precision._session import AuditSession
    from nanhunt.precision._state import module_state_kept

    if steps < 1:
        raise NanhuntError("steps must be at least 1")
    run = RunInfo(command=["nanhunt.audit"], script=type(model).__name__,
                  python=platform.python_version(), torch=torch.__version__,
                  nanhunt=__version__, platform=host_platform(),
                  started=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    p = next(model.parameters(), None)
    run.device = str(p.device) if p is not None else "cpu"
    session = AuditSession(parse_targets(target), steps=steps, warmup=0, label="model")
    # the forward the audit itself makes must not move BatchNorm statistics (nor a forward
    # that edits its own weights in place): put them back
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    weights = {n: (p, p.detach().clone(), p._version) for n, p in model.named_parameters()}
    try:
        with isolated(neutral=False), module_state_kept([model]), session:
            for _ in range(steps):
                inputs, labels = batch_fn()
                with torch.enable_grad():
                    output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
                    loss = loss_fn(output, labels)
                session.measure(loss)
                session.auditor.tape.clear()
                if session.done:
                    break
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
            for p, saved, version in weights.values():
                if p._version != version:
                    p.copy_(saved)
    run.finished = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    trace = build_trace(session, run)
    if out is not None:
        from nanhunt.report import write_reports

        write_reports(trace, out)
    return trace


def parse_targets(text: str | list[str] | None) -> list[str] | None:
    """``"float16,bf16"`` -> ``["float16", "bfloat16"]`` (None: the run's own format)."""
    from nanhunt.formats import get_format

    if text is None:
        return None
    items = text.split(",") if isinstance(text, str) else list(text)
    names = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        fmt = get_format(item)
        if fmt.name == "float32":
            raise NanhuntError("--target float32: the audit compares a format against float32")
        if fmt.name not in names:
            names.append(fmt.name)
    if not names:
        raise NanhuntError("--target needs at least one format")
    return names
