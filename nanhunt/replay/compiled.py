"""Inside a compiled module: its failing call replayed eagerly, to name the layer.

During the run a ``torch.compile``'d module is observed only at its boundary (see
:mod:`nanhunt.capture.compiled`): the run stays the plain compiled run. When the first failure
is such a module's output, :func:`look_inside` replays the module's original (uncompiled) code on
copies of the captured inputs, under a session of its own, with the captured autocast state:

* the replay goes non-finite too: its first failure (the layer inside, its tensor and values)
  becomes the run's, at the run's step and phase, and its culprit snapshot is the one the op-level
  zoom and the fix verification replay;
* the replay stays finite: only the compiled code made the non-finite values (a fused kernel, a
  precision cast the compiler dropped or moved). The report says so, with what to try next.

The replay follows the replay contract (:mod:`nanhunt.contract`): copies, declared and
capped, and the ambient state put back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from nanhunt.trace import Trace

__all__ = ["COMPILER_HINT", "compiled_evidence", "look_inside"]

_ONLY_COMPILED = "its original code stays finite"

COMPILER_HINT = (
    "to find the compiled code's culprit: rerun with TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1 "
    "(torch._inductor.config.emulate_precision_casts = True: inductor then rounds as eager "
    "does), or bisect the compiler with TORCH_BISECT_BACKEND=inductor "
    "(torch._inductor.compiler_bisector); torch.compile(..., backend='aot_eager') tells a "
    "Dynamo/AOT problem from an inductor one")


def _compiled_original(module: Any) -> Any:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:
        return None
    return module._orig_mod if isinstance(module, OptimizedModule) else None


def look_inside(trace: Trace, snap: Any) -> Any:
    """Replay a compiled culprit eagerly; return the snapshot the later stages should use (the
    layer inside, or the original module when the replay stayed finite), or None when ``snap``
    is not a compiled module's forward call."""
    ff = trace.first_failure
    inner = _compiled_original(snap.module)
    if inner is None or ff is None or snap.phase != "forward":
        return None
    from nanhunt.capture import Hunt
    from nanhunt.contract import Copies, isolated

    copies = Copies()
    module = copies.module(inner, f"compiled module {ff.module}")
    args, kwargs = copies.tree((snap.args, snap.kwargs or {}), "its captured inputs")
    enabled, dtype = snap.autocast
    p = next(module.parameters(), None)
    device = p.device.type if p is not None else "cpu"
    hunt = Hunt(module, target=trace.run.target or "auto", stop_on_problem=False)
    with isolated():  # RNGs, grad mode and autocast put back afterwards
        autocast = torch.autocast(device, dtype=dtype, enabled=bool(enabled and dtype))
        with hunt, autocast:
            module(*args, **kwargs)
    label = type(module).__name__
    found = hunt.first_failure
    outer = ff.module
    if found is None or found.phase != "forward":
        note = (f"{outer} is compiled (torch.compile): replayed eagerly on the captured inputs "
                f"of step {ff.step}, {_ONLY_COMPILED}, so the non-finite values came from the "
                "compiled code itself (a compiler-only NaN); " + COMPILER_HINT)
        ff.detail = f"{ff.detail}; {note}" if ff.detail else note
        trace.notes.append(note)
        return dataclasses.replace(snap, module=inner)
    known = {layer.module for layer in trace.layers}
    if found.module == label:  # the compiled module's own code, between its layers
        name = outer
    elif found.module in known:
        name = found.module
    else:
        name = f"{outer}.{found.module}"
    where = (f"inside the compiled module {outer}: located by replaying its original code "
             "eagerly on the captured inputs (the run observed it only at its boundary)")
    new = dataclasses.replace(found, step=ff.step, phase=ff.phase, module=name, rank=ff.rank,
                              detail=f"{found.detail}; {where}" if found.detail else
                              where[0].upper() + where[1:])
    trace.first_failure = new
    inner_snap = hunt.snapshot
    if inner_snap is None:
        return dataclasses.replace(snap, module=inner)
    return dataclasses.replace(inner_snap, name=name, step=ff.step,
                               call_site=inner_snap.call_site or snap.call_site)


def compiled_evidence(trace: Trace) -> None:
    """After the diagnosis: a compiler-only NaN says so first in its evidence (the rules judge
    the boundary's values, and cannot tell the compiled code from the module's own)."""
    note = next((n for n in trace.notes if _ONLY_COMPILED in n), None)
    if note is not None and trace.diagnosis is not None and note not in trace.diagnosis.evidence:
        trace.diagnosis.evidence.insert(0, note)
