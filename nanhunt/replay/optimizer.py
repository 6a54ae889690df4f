"""Optimizer replay: the failing optimizer step run again on a copy of the optimizer (its
parameters, their gradients and its state, copied just before the step) under the op recorder:
:func:`zoom_optimizer` names the first op that made a parameter non-finite."""

from __future__ import annotations

import torch

from nanhunt.capture.state import OptimizerSnapshot
from nanhunt.contract import Copies, CopyRefused, isolated
from nanhunt.replay.ops import OptimizerOpRecorder, ReplayResult
from nanhunt.trace import Trace

__all__ = ["replay_optimizer", "zoom_optimizer"]

def replay_optimizer(snap: OptimizerSnapshot, *, eps: float | None = None) -> ReplayResult:
    """Run the copied optimizer's step on copies of its parameters under the op recorder;
    ``eps`` replaces every param group's eps first (to check that fix)."""
    result = ReplayResult()
    try:
        optimizer = Copies().optimizer(snap.optimizer, label=f"the {snap.type} copy")
    except CopyRefused as exc:
        result.error = str(exc)
        return result
    if eps is not None:
        for group in optimizer.param_groups:
            group["eps"] = eps
    recorder = OptimizerOpRecorder()
    try:
        with isolated(), recorder:
            optimizer.step()
    except Exception as exc:  # report, do not crash
        result.error = f"{type(exc).__name__}: {exc}"
    params = [p for g in optimizer.param_groups for p in g["params"]]
    result.outputs_finite = all(bool(torch.isfinite(p).all()) for p in params)
    result.ops, result.first, result.dropped_ops = recorder.ops, recorder.first, recorder.dropped
    return result


def zoom_optimizer(trace: Trace, snap: OptimizerSnapshot) -> None:
    """Name the first aten op of the failing optimizer step that made a non-finite value."""
    f = trace.first_failure
    if f is None or f.phase != "optimizer" or f.step != snap.step:
        return
    result = replay_optimizer(snap)
    if result.error:
        trace.notes.append(f"replaying {snap.type}.step() raised {result.error}")
    if result.first is None:
        trace.notes.append(
            f"replaying {snap.type}.step() on copies of its parameters, gradients and state "
            "gave finite parameters: the failure did not reproduce")
        return
    trace.ops = result.ops
    f.op = result.first.op
    src = result.first.source
    if src:
        f.source, _, f.source_line = src.partition("  ")
