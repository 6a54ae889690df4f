"""Module replay: the culprit module run again on its captured inputs, on a copy and under the
replay contract (:mod:`nanhunt.contract`), with the op recorder (:mod:`.ops`); :func:`zoom_into`
names the failure's op and source line from it."""

from __future__ import annotations

from typing import Any

import torch

from nanhunt.capture._util import map_tensors, tensor_leaves
from nanhunt.capture.state import Snapshot
from nanhunt.contract import Copies, CopyRefused, isolated
from nanhunt.replay.ops import OpRecorder, ReplayResult
from nanhunt.trace import InputRange, Trace

__all__ = ["DTYPES", "float_tensors", "input_ranges", "map_floats", "replay", "tensors",
           "zoom_into"]

def _to_dtype(obj: Any, dtype: torch.dtype | None, requires_grad: bool) -> Any:
    """Fresh copies of the captured inputs, floats converted to ``dtype``."""

    def prepare(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        if t.is_floating_point():
            if dtype is not None:
                t = t.to(dtype)
            if requires_grad:
                t.requires_grad_(True)
        return t

    return map_tensors(obj, prepare)


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _device_type(snap: Snapshot) -> str:
    p = next(snap.module.parameters(), None)
    if p is not None:
        return p.device.type
    leaves: list = []
    tensor_leaves((snap.args, snap.kwargs), "", leaves)
    return leaves[0][1].device.type if leaves else "cpu"


def replay(snap: Snapshot, dtype: str | None = None, *, module_fix: Any = None,
           output_fix: Any = None, input_fix: Any = None,
           op_floor: tuple[str, float] | None = None,
           backward: bool | None = None) -> ReplayResult:
    """Run the snapshot's module on its captured inputs under the op recorder.

    ``dtype`` None replays as captured (same autocast state); "float32" etc. converts the
    module and inputs and disables autocast. ``module_fix(module)`` edits the module copy
    (a new eps); ``output_fix(output)`` transforms the output (a clamp) before it is judged.
    """
    result = ReplayResult()
    try:
        module = Copies().module(snap.module, f"the culprit {snap.name}")
    except CopyRefused as exc:
        result.error = str(exc)
        return result
    with isolated():
        _replay_module(snap, module, result, dtype, module_fix, output_fix, input_fix,
                       op_floor, backward)
    return result


def _replay_module(snap: Snapshot, module: Any, result: ReplayResult, dtype: str | None,
                   module_fix: Any, output_fix: Any, input_fix: Any,
                   op_floor: tuple[str, float] | None, backward: bool | None) -> None:
    has_grads = bool(snap.grad_outputs) and any(g is not None for g in snap.grad_outputs)
    if backward is None:  # by default only a backward failure is replayed through backward
        backward = snap.phase in ("backward", "loss_scaling") and has_grads
    target_dtype = DTYPES.get(dtype) if dtype else None
    if target_dtype is not None:
        module = module.to(target_dtype)
    if module_fix is not None:
        module_fix(module)
    want_backward = backward
    args = _to_dtype(snap.args, target_dtype, want_backward)
    kwargs = _to_dtype(snap.kwargs or {}, target_dtype, False)
    if input_fix is not None:
        with torch.no_grad():
            args = map_floats(args, lambda t: input_fix(t).requires_grad_(t.requires_grad))
    device_type = _device_type(snap)
    if target_dtype is None:
        enabled, ac_dtype = snap.autocast
    else:
        enabled, ac_dtype = False, None
    autocast = (torch.autocast(device_type, dtype=ac_dtype, enabled=True) if enabled and ac_dtype
                else torch.autocast(device_type, enabled=False))
    recorder = OpRecorder(op_floor)
    try:
        with torch.enable_grad(), torch.autograd.set_detect_anomaly(True, check_nan=False):
            with autocast, recorder:
                out = module(*args, **kwargs)
            if output_fix is not None:
                out = output_fix(out)
            leaves: list = []
            tensor_leaves(out, "", leaves)
            outs = [t for _, t in leaves if t.is_floating_point()]
            result.outputs_finite = all(bool(torch.isfinite(t).all()) for t in outs)
            result.output_amax = max(
                (float(t.detach().float().abs().nan_to_num(0, 0, 0).amax()) for t in outs
                 if t.numel()), default=0.0)
            if want_backward:
                grads_out = snap.grad_outputs or [torch.ones_like(o) for o in outs]
                pairs = [(o, g) for o, g in zip(outs, grads_out)
                         if g is not None and o.requires_grad]
                if pairs:
                    with recorder:
                        torch.autograd.backward([o for o, _ in pairs],
                                                [g.to(o.dtype) for o, g in pairs])
                    grads = [a.grad for _, a in float_tensors(args) if a.grad is not None]
                    grads += [p.grad for p in module.parameters() if p.grad is not None]
                    result.grads_finite = all(bool(torch.isfinite(g).all()) for g in grads)
    except Exception as exc:  # the culprit may raise on its own inputs; report, do not crash
        result.error = f"{type(exc).__name__}: {exc}"
    if recorder.first is None and recorder.weak is not None:
        recorder.first = recorder.weak
        recorder.weak.first_nonfinite = True
    if snap.call_site is not None:
        # an op of torch's own module (nn.Linear) runs in no frame of the user's: its user line
        # is the one that called the module
        fname, line, text = snap.call_site
        caller = f"{fname}:{line}" + (f"  {text}" if text else "")
        for op in recorder.ops:
            if not op.source:
                op.source = caller
    result.ops, result.first, result.dropped_ops = recorder.ops, recorder.first, recorder.dropped


def float_tensors(obj: Any) -> list:
    leaves: list = []
    tensor_leaves(obj, "", leaves)
    return [(p, t) for p, t in leaves if t.is_floating_point()]


def zoom_into(trace: Trace, snap: Snapshot) -> None:
    """Name the first non-finite aten op of the culprit and the user's source line."""
    f = trace.first_failure
    if f is None or f.phase in ("data", "optimizer"):
        # a bad batch is bad before any op runs; an optimizer's op is zoom_optimizer's (a
        # forward replay would only show the non-finite weight being read)
        return
    if snap.stale_inputs:
        trace.notes.append(
            f"the captured inputs of {snap.name} ({', '.join(snap.stale_inputs)}) were changed "
            "in place after capture; the op-level replay is not trusted")
    if f.module == snap.name:
        f.inputs = input_ranges(snap)
    result = replay(snap)
    trace.ops = result.ops
    if result.error:
        trace.notes.append(f"replaying {snap.name} raised {result.error}")
    first = result.first
    if first is None:
        trace.notes.append(
            f"replaying {snap.name} alone on its captured inputs gave finite values: the failure "
            "did not reproduce in isolation (state outside the module, randomness such as "
            "dropout, or a fused/compiled kernel)")
        return
    if f.module != snap.name and f.phase != "data":
        return
    f.op = first.op
    src = first.source
    if src and "  " in src:
        f.source, f.source_line = src.split("  ", 1)
    elif src:
        f.source = src
    elif snap.call_site is not None:  # the op ran inside torch's own module: name the caller
        fname, line, text = snap.call_site
        f.source, f.source_line = f"{fname}:{line}", text


@torch.no_grad()
def input_ranges(snap: Snapshot, limit: int = 8) -> list[InputRange]:
    """Exact ranges of the culprit's floating inputs (the values its failing call received)."""
    leaves: list = []
    tensor_leaves(snap.args, "input", leaves)
    tensor_leaves(snap.kwargs or {}, "kwargs", leaves)
    out = []
    for path, t in leaves:
        if not t.is_floating_point() or t.numel() == 0:
            continue
        f = t.detach().double()
        fin = torch.isfinite(f)
        vals = f[fin]
        some = vals.numel() > 0
        out.append(InputRange(
            path=path, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
            min=float(vals.min()) if some else 0.0, max=float(vals.max()) if some else 0.0,
            amax=float(vals.abs().max()) if some else 0.0,
            mean=float(vals.mean()) if some else 0.0,
            std=float(vals.std()) if vals.numel() > 1 else 0.0,
            nonfinite=int((~fin).sum())))
        if len(out) >= limit:
            break
    return out


def tensors(obj: Any) -> list[torch.Tensor]:
    leaves: list = []
    tensor_leaves(obj, "", leaves)
    return [t for _, t in leaves]


def map_floats(obj: Any, fn: Any) -> Any:
    """Apply ``fn`` to the floating-point tensors in ``obj``."""
    return map_tensors(obj, lambda t: fn(t) if t.is_floating_point() else t)
