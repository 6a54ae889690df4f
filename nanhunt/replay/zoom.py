"""Replay the culprit module with its captured inputs: op-level zoom, snapshots, verification.

The one stage after capture that goes back to torch. A :class:`TorchDispatchMode` sees every
aten op of the replay, forward and backward, so the first op that produced a non-finite value
is named, with the user's source line that called it.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import io
import linecache
import math
import runpy
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanhunt._paths import PACKAGE_DIR
from nanhunt.capture._util import map_tensors, tensor_leaves
from nanhunt.capture.state import OptimizerSnapshot, Snapshot
from nanhunt.errors import NanhuntError
from nanhunt.formats import get_format
from nanhunt.trace import InputRange, OpRecord, Trace

__all__ = [
    "ReplayResult",
    "load_snapshot",
    "print_replay",
    "replay",
    "replay_optimizer",
    "save_snapshot",
    "verify",
    "verify_optimizer",
    "why_not_verified",
    "zoom_into",
    "zoom_optimizer",
]

_SNAPSHOT_FORMAT = "nanhunt-snapshot"
_SNAPSHOT_VERSION = 1
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_OUR_DIR = str(Path(PACKAGE_DIR).resolve())
_MAX_OPS = 400
_MASK_OPS = {f"aten.{n}" for n in ("masked_fill", "masked_fill_", "fill", "fill_", "full",
                                    "full_like", "where", "index_put", "index_put_", "scatter",
                                    "copy_", "_to_copy", "triu", "tril", "new_full")}
# ops whose floor goes on the denominator, not the first argument
_FLOOR_ARG = {"div": 1, "remainder": 1, "fmod": 1}


@dataclass
class ReplayResult:
    ops: list[OpRecord] = field(default_factory=list)
    first: OpRecord | None = None
    outputs_finite: bool = True
    output_amax: float = 0.0
    grads_finite: bool | None = None
    error: str | None = None
    dropped_ops: int = 0


def _user_source() -> tuple[str | None, str | None]:
    """file:line and text of the innermost frame that is not torch's or nanhunt's."""
    frame = sys._getframe(2)
    while frame is not None:
        fname = frame.f_code.co_filename
        if fname.startswith(_OUR_DIR):
            return None, None  # reached the replay itself: the op ran in torch's own code
        if not (fname.startswith(_TORCH_DIR) or fname.startswith("<")):
            line = linecache.getline(fname, frame.f_lineno).strip() or None
            return f"{fname}:{frame.f_lineno}", line
        frame = frame.f_back
    return None, None


def _node_source() -> tuple[str | None, str | None]:
    """In backward: the forward call that created the running autograd node (anomaly mode)."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None, None
    stack = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
    if not stack:
        return None, None
    text = "".join(stack) if isinstance(stack, list) else str(stack)
    best = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            fname = line.split('"')[1]
            if fname.startswith(_OUR_DIR):
                best = None  # outermost first: frames before the replay's own are not in it
            elif not (fname.startswith(_TORCH_DIR)
                    or fname.startswith("<")):  # (<frozen runpy>: the interpreter's own)
                try:
                    lineno = int(line.split("line ")[1].split(",")[0])
                except (IndexError, ValueError):
                    continue
                best = (fname, lineno)
    if best is None:
        return None, None
    return f"{best[0]}:{best[1]}", linecache.getline(best[0], best[1]).strip() or None


class _OpRecorder(TorchDispatchMode):
    """Record every aten op's output range; remember the first non-finite one."""

    def __init__(self, op_floor: tuple[str, float] | None = None) -> None:
        super().__init__()
        self.ops: list[OpRecord] = []
        self.first: OpRecord | None = None
        self.dropped = 0
        self.op_floor = op_floor  # (op name, minimum): floor that op's input (a fix)
        self.weak: OpRecord | None = None  # the first -inf from a mask-building op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.op_floor and torch._C._current_graph_task_id() == -1 and \
                str(getattr(func, "overloadpacket", "")) == f"aten.{self.op_floor[0]}":
            i = _FLOOR_ARG.get(self.op_floor[0], 0)
            if len(args) > i and isinstance(args[i], torch.Tensor) and \
                    args[i].is_floating_point():
                args = (*args[:i], args[i].clamp_min(self.op_floor[1]), *args[i + 1:])
        out = func(*args, **(kwargs or {}))
        leaves: list = []
        tensor_leaves(out, "", leaves)
        floats = [t for _, t in leaves if t.is_floating_point() and t.numel() > 0]
        if not floats:
            return out
        amax, nonfinite, numel, strong, zeros = 0.0, 0, 0, False, 0
        for t in floats:
            f = t.detach().float()
            fin = torch.isfinite(f)
            bad = int((~fin).sum())
            nonfinite += bad
            numel += t.numel()
            zeros += int((f == 0).sum())
            if bad and bool((torch.isnan(f) | (f == math.inf)).any()):
                strong = True  # NaN or +inf: not a -inf mask being built
            if fin.any():
                amax = max(amax, float(f.abs().masked_fill(~fin, 0).amax()))
        backward = torch._C._current_graph_task_id() != -1
        source, line = _node_source() if backward else _user_source()
        name = str(getattr(func, "overloadpacket", func))
        rec = OpRecord(index=len(self.ops) + self.dropped, op=name,
                       phase="backward" if backward else "forward",
                       dtype=str(floats[0].dtype).removeprefix("torch."), amax=amax,
                       nonfinite=nonfinite, numel=numel, source=source,
                       scalars=_scalars(args, kwargs), zeros=zeros)
        if line:
            rec.source = f"{source}  {line}" if source else line
        # a -inf made by masked_fill/full/where is how masks are built: the first op that
        # made NaN or +inf is the culprit, unless nothing else went non-finite
        if nonfinite and self.first is None and (strong or name not in _MASK_OPS):
            rec.first_nonfinite = True
            self.first = rec
        elif nonfinite and self.weak is None:
            self.weak = rec
        if len(self.ops) < _MAX_OPS or rec.first_nonfinite:
            self.ops.append(rec)
        else:
            self.dropped += 1
        return out


def _scalars(args: tuple, kwargs: dict | None) -> list[float]:
    """The Python numbers an op was called with (an eps, a fill value, alpha), and one-element
    tensors that hold one: the constants a hand-written norm or mask brings to the op."""
    out: list[float] = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, float) or (isinstance(a, int) and not isinstance(a, bool)):
            out.append(float(a))
        elif isinstance(a, torch.Tensor) and a.numel() == 1 and a.dim() == 0 and \
                a.is_floating_point():
            out.append(float(a.detach().float()))
    return out[:4]


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


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
    module = copy.deepcopy(snap.module)
    has_grads = bool(snap.grad_outputs) and any(g is not None for g in snap.grad_outputs)
    if backward is None:  # by default only a backward failure is replayed through backward
        backward = snap.phase in ("backward", "loss_scaling") and has_grads
    target_dtype = _DTYPES.get(dtype) if dtype else None
    if target_dtype is not None:
        module = module.to(target_dtype)
    if module_fix is not None:
        module_fix(module)
    want_backward = backward
    args = _to_dtype(snap.args, target_dtype, want_backward)
    kwargs = _to_dtype(snap.kwargs or {}, target_dtype, False)
    if input_fix is not None:
        with torch.no_grad():
            args = _map_tensors(args, lambda t: input_fix(t).requires_grad_(t.requires_grad))
    device_type = _device_type(snap)
    if target_dtype is None:
        enabled, ac_dtype = snap.autocast
    else:
        enabled, ac_dtype = False, None
    autocast = (torch.autocast(device_type, dtype=ac_dtype, enabled=True) if enabled and ac_dtype
                else torch.autocast(device_type, enabled=False))
    recorder = _OpRecorder(op_floor)
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
                    grads = [a.grad for _, a in _float_leaves(args) if a.grad is not None]
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
    return result


def _float_leaves(obj: Any) -> list:
    leaves: list = []
    tensor_leaves(obj, "", leaves)
    return [(p, t) for p, t in leaves if t.is_floating_point()]


# ----------------------------------------------------------------------------- zoom + verify


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


_OPTIM_DIR = str(Path(torch.optim.__file__).resolve().parent)


def _optimizer_source() -> str | None:
    """The line of torch's optimizer code running the op: ``adam.py:423  denom = ...``."""
    frame = sys._getframe(2)
    while frame is not None:
        fname = frame.f_code.co_filename
        if fname.startswith(_OUR_DIR):
            return None
        if fname.startswith(_OPTIM_DIR) and not fname.endswith(("optimizer.py", "_functional.py")):
            text = linecache.getline(fname, frame.f_lineno).strip()
            return f"torch/optim/{Path(fname).name}:{frame.f_lineno}  {text}"
        frame = frame.f_back
    return None


class _OptimizerOpRecorder(_OpRecorder):
    """The op recorder for an optimizer step: the source is torch's optimizer line."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        n = len(self.ops)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.ops) > n:
            rec = self.ops[-1]
            rec.phase = "optimizer"
            rec.source = _optimizer_source()
        return out


def replay_optimizer(snap: OptimizerSnapshot, *, eps: float | None = None) -> ReplayResult:
    """Run the copied optimizer's step on copies of its parameters under the op recorder;
    ``eps`` replaces every param group's eps first (to check that fix)."""
    result = ReplayResult()
    optimizer = copy.deepcopy(snap.optimizer)
    if eps is not None:
        for group in optimizer.param_groups:
            group["eps"] = eps
    recorder = _OptimizerOpRecorder()
    try:
        with recorder:
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


def verify_optimizer(trace: Trace, snap: OptimizerSnapshot) -> None:
    """Replay the failing optimizer step with each optimizer eps recommended."""
    f = trace.first_failure
    if f is None or f.phase != "optimizer" or f.step != snap.step:
        return
    for rec in trace.recommendations:
        if rec.type != "eps" or rec.data.get("where") != "optimizer":
            continue
        r = replay_optimizer(snap, eps=float(rec.value))
        rec.verified = r.error is None and r.first is None and r.outputs_finite
        rec.verification = (
            f"replayed the step-{snap.step} {snap.type}.step() on copies of its parameters, "
            f"gradients and state with eps={float(rec.value):g}: "
            + ("every parameter finite" if rec.verified else "still non-finite"))
        _as_replay_check(rec)  # a replayed step is not a run that trained: never "verified"
    trace.recommendations.sort(key=lambda r: not (r.verified or r.check == "replay"))


def _matches(rec_module: str | None, name: str) -> bool:
    if not rec_module:
        return False
    return rec_module == name or fnmatch.fnmatchcase(name, rec_module)


def verify(trace: Trace, snap: Snapshot) -> None:
    """Check each recommendation that a replay of the culprit can check, and say how.

    A replay with the fix applied that came out finite (and, for float32 regions, back inside
    the target's range after the cast back) labels it "checked by replaying the culprit";
    only a re-run of the training (nanhunt.experiment.verify) marks it verified.
    """
    fmt = get_format(trace.run.target)
    if snap.stale_inputs:
        for rec in trace.recommendations:
            rec.verification = "not checked: the captured inputs changed in place after capture"
        return
    baseline = replay(snap)
    reproduced = baseline.first is not None or not baseline.outputs_finite or \
        baseline.grads_finite is False
    for rec in trace.recommendations:
        if rec.type not in ("fp32_module", "clamp", "eps") or rec.data.get("where") == "optimizer":
            rec.verification = rec.verification or _why_not(rec.type)
            continue
        if not reproduced:
            rec.verification = (f"not checked: replaying {snap.name} alone on its captured "
                                "inputs did not reproduce the failure")
            continue
        if rec.type == "fp32_module":
            _verify_fp32(rec, snap, fmt)
        elif rec.type == "clamp":
            _verify_clamp(rec, snap)
        elif rec.type == "eps":
            _verify_eps(rec, snap)
        _as_replay_check(rec)


def _as_replay_check(rec: Any) -> None:
    """A replay is a check of the culprit's call, not of training: never "verified"."""
    ok, text = rec.verified, rec.verification
    rec.verified = False
    if not text or text.startswith("not checked"):
        return
    rec.replay = text
    rec.check = "replay" if ok else ""
    rec.verification = ("checked by replaying the culprit: " if ok else "not verified: ") + text


def _finite(r: ReplayResult) -> bool:
    return r.error is None and r.first is None and r.outputs_finite and r.grads_finite is not False


def _verify_fp32(rec: Any, snap: Snapshot, fmt: Any) -> None:
    region = [str(m) for m in rec.data.get("region") or [rec.module or snap.name]]
    cast_to = rec.data.get("cast_to")
    if region == [snap.name] or (len(region) == 1 and fnmatch.fnmatchcase(snap.name, region[0])):
        r = replay(snap, "float32")
        fits = _finite(r) and r.output_amax <= fmt.max
        rec.verified = fits
        # cast back, it is inf again: re-run verification skips the fixes that cast it back
        rec.data["fp32_exceeds"] = _finite(r) and r.output_amax > fmt.max
        if r.error is not None:
            outcome = f"the replay raised {r.error}"
        elif fits:
            outcome = (f"output amax {r.output_amax:.3g} fits {fmt.name} (max {fmt.max:g}), "
                       "all finite")
        elif not _finite(r):
            outcome = "still non-finite in float32: not a range problem float32 can fix"
        else:
            outcome = (f"output amax {r.output_amax:.3g} still exceeds {fmt.name}'s max "
                       f"{fmt.max:g} when cast back")
        rec.verification = f"replayed {snap.name} in float32 on the step-{snap.step} inputs: " \
            + outcome
        return
    for anc in snap.ancestors:
        names = {full: rel for rel, full in anc.names.items()}
        chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in region)]
        if snap.name not in chosen or not all(
                any(fnmatch.fnmatchcase(n, p) for n in chosen) for p in region):
            continue
        last = chosen[-1]

        def wrap(module: Any, chosen: list[str] = chosen, names: dict = names,
                 last: str = last) -> None:
            for full in chosen:
                rel = names[full]
                _run_in_float32(module.get_submodule(rel),
                                _DTYPES.get(cast_to) if full == last else None)

        r = replay(anc, module_fix=wrap)
        rec.verified = _finite(r)
        rec.verification = (
            f"replayed {anc.name} on its step-{snap.step} inputs with {', '.join(chosen)} in "
            f"float32{' (cast back to ' + cast_to + ' after ' + last + ')' if cast_to else ''}"
            + (": all finite" if rec.verified else ": still non-finite"
               + (f" ({r.error})" if r.error else "")))
        return
    if not any(fnmatch.fnmatchcase(snap.name, p) for p in region):
        rec.verification = (f"not checked: the replay captured {snap.name}, which this "
                            "recommendation does not change")
    else:
        rec.verification = ("not checked: no captured call encloses the whole float32 region "
                            f"({', '.join(region)})")


def _run_in_float32(module: Any, cast_to: torch.dtype | None) -> None:
    forward = module.forward

    def fp32_forward(*args: Any, **kwargs: Any) -> Any:
        device = next((t.device.type for t in _tensors(args)), "cpu")
        with torch.autocast(device, enabled=False):
            out = forward(*_map_tensors(args, lambda t: t.float()),
                          **_map_tensors(kwargs, lambda t: t.float()))
        return _map_tensors(out, lambda t: t.to(cast_to)) if cast_to else out

    module.forward = fp32_forward


def _tensors(obj: Any) -> list[torch.Tensor]:
    leaves: list = []
    tensor_leaves(obj, "", leaves)
    return [t for _, t in leaves]


def _verify_clamp(rec: Any, snap: Snapshot) -> None:
    where = rec.data.get("where", "output")
    value = float(rec.value) if isinstance(rec.value, (int, float)) else None
    if where == "output":
        bound = float(rec.data.get("bound", value))
        r = replay(snap, output_fix=lambda out: _map_tensors(
            out, lambda t: torch.clamp(t, -bound, bound)))
        what = f"its output clamped to ±{bound:g}"
    elif where == "input":
        low = float(rec.data.get("min", value))
        r = replay(snap, input_fix=lambda t: t.clamp_min(low), backward=True)
        what = f"its inputs floored at {low:g}"
    elif where == "op_input":
        op, low = str(rec.data.get("op")), float(rec.data.get("min", value))
        r = replay(snap, op_floor=(op, low), backward=True)
        what = f"the input of aten.{op} floored at {low:g} (forward and backward)"
    else:
        rec.verification = _why_not(rec.type)
        return
    # an output clamp acts after the op that overflowed: judge what comes out
    rec.verified = r.error is None and r.outputs_finite if where == "output" else _finite(r)
    rec.verification = f"replayed {snap.name} with {what}: " + (
        "all finite" if rec.verified else "still non-finite"
        + (f" ({r.error})" if r.error else ""))


def _verify_eps(rec: Any, snap: Snapshot) -> None:
    attrs = [a for a in rec.data.get("attrs", ("eps",)) if hasattr(snap.module, a)]
    if not attrs:
        rec.verification = f"not checked: {snap.name} has no eps attribute to change"
        return
    value = float(rec.value)

    def set_eps(m: Any) -> None:
        for a in attrs:
            setattr(m, a, value)

    r = replay(snap, module_fix=set_eps, backward=True)
    rec.verified = _finite(r)
    rec.verification = f"replayed {snap.name} with {attrs[0]}={value:g}: " + (
        "all finite" if rec.verified else "still non-finite")


def why_not_verified(kind: str, *, captured: bool = True) -> str:
    """Why a recommendation of this type was not checked by a replay."""
    if not captured and kind in ("fp32_module", "clamp", "eps"):
        return "not checked: no culprit module call was captured to replay"
    return _why_not(kind)


def _why_not(kind: str) -> str:
    return {
        "init_scale": "not checked by replay: a loss scale acts over training steps",
        "clip_grad_norm": "not checked by replay: clipping acts over training steps",
        "lower_lr": "not checked by replay: the learning rate acts over training steps",
        "fix_data": "not checked by replay: needs the data pipeline",
        "normalize_input": "not checked by replay: needs the data pipeline",
        "scaler_usage": "not checked by replay: the fix is in the training loop",
    }.get(kind, "not checked: no captured culprit to replay this on")


def _map_tensors(obj: Any, fn: Any) -> Any:
    """Apply ``fn`` to the floating-point tensors in ``obj``."""
    return map_tensors(obj, lambda t: fn(t) if t.is_floating_point() else t)


# ----------------------------------------------------------------------------- snapshots


@contextlib.contextmanager
def _main_module_from(globals_: dict | None):
    """Make ``__main__`` resolve to the user's script globals while pickling/unpickling."""
    if globals_ is None:
        yield
        return
    saved = sys.modules.get("__main__")
    fake = types.ModuleType("__main__")
    fake.__dict__.update(globals_)
    sys.modules["__main__"] = fake
    try:
        yield
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _script_globals(module: torch.nn.Module) -> dict | None:
    for m in module.modules():
        if type(m).__module__ == "__main__":
            fwd = type(m).__dict__.get("forward") or type(m).__dict__.get("__init__")
            if fwd is not None and hasattr(fwd, "__globals__"):
                return fwd.__globals__
    return None


def save_snapshot(snap: Snapshot, path: Path, *, script: str = "") -> str:
    """Write the culprit (class and state), its inputs and grad_outputs to ``path``."""
    from nanhunt.report.files import atomic_write_bytes

    buf = io.BytesIO()
    with _main_module_from(_script_globals(snap.module)):
        torch.save(snap.module, buf)
    payload = {
        "format": _SNAPSHOT_FORMAT,
        "version": _SNAPSHOT_VERSION,
        "name": snap.name,
        "phase": snap.phase,
        "step": snap.step,
        "class": f"{type(snap.module).__module__}.{type(snap.module).__qualname__}",
        "script": str(Path(script).resolve()) if script else "",
        "autocast": [snap.autocast[0], str(snap.autocast[1]).removeprefix("torch.")
                     if snap.autocast[1] is not None else None],
        "module_bytes": buf.getvalue(),
        "args": snap.args,
        "kwargs": snap.kwargs,
        "grad_outputs": snap.grad_outputs,
        "stale_inputs": snap.stale_inputs,
        "call_site": list(snap.call_site) if snap.call_site else None,
    }
    out = io.BytesIO()
    torch.save(payload, out)
    atomic_write_bytes(Path(path), out.getvalue())
    return str(path)


def load_snapshot(path: str | Path, *, script: str | None = None) -> Snapshot:
    """Load a snapshot written by :func:`save_snapshot`; classes from the training script
    need the script (``script=``, or the recorded path when it guards its training with
    ``if __name__ == "__main__":``)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise NanhuntError(f"no such snapshot: {path}") from None
    except Exception as exc:
        raise NanhuntError(f"{path} is not a nanhunt snapshot ({type(exc).__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != _SNAPSHOT_FORMAT:
        raise NanhuntError(f"{path} is not a nanhunt snapshot")
    if payload.get("version") != _SNAPSHOT_VERSION:
        raise NanhuntError(f"snapshot version {payload.get('version')} is not supported")
    cls = payload["class"]
    globals_ = None
    if cls.startswith("__main__."):
        script = script or payload.get("script") or None
        if script is None or not Path(script).exists():
            raise NanhuntError(
                f"the culprit's class {cls[9:]} is defined in the training script; "
                "pass it with --script train.py")
        if script != payload.get("script") or _guarded(Path(script)):
            globals_ = runpy.run_path(str(script), run_name="__nanhunt_replay__")
        else:
            raise NanhuntError(
                f"the culprit's class {cls[9:]} is defined in {script}, which has no "
                "'if __name__ == \"__main__\":' guard; pass --script explicitly to import it "
                "(its top-level code will run)")
    try:
        with _main_module_from(globals_):
            module = torch.load(io.BytesIO(payload["module_bytes"]), map_location="cpu",
                                weights_only=False)
    except (AttributeError, ModuleNotFoundError, ImportError) as exc:
        raise NanhuntError(f"cannot import the culprit's class {cls}: {exc}") from None
    enabled, dtype = payload["autocast"]
    return Snapshot(module=module, name=payload["name"], args=payload["args"],
                    kwargs=payload["kwargs"], grad_outputs=payload["grad_outputs"],
                    autocast=(bool(enabled), getattr(torch, dtype) if dtype else None),
                    phase=payload["phase"], step=payload["step"],
                    stale_inputs=list(payload.get("stale_inputs") or []),
                    call_site=tuple(payload["call_site"]) if payload.get("call_site") else None)


def _guarded(path: Path) -> bool:
    text = path.read_text(encoding="utf-8", errors="replace")
    return "__name__" in text and "__main__" in text


def print_replay(snap: Snapshot, result: ReplayResult, console: Any) -> None:
    """The op-level trace of a replay, the first non-finite op marked."""
    from rich.table import Table

    console.print(f"[bold]replay of {snap.name}[/] ({type(snap.module).__name__}, "
                  f"step {snap.step}, failure in {snap.phase})")
    table = Table(show_edge=False, pad_edge=False)
    for col in ("#", "op", "phase", "dtype", "amax", "non-finite", "source"):
        table.add_column(col, overflow="fold")
    for op in result.ops:
        mark = "[bold red]▶[/] " if op.first_nonfinite else ""
        source = op.source or ""
        if source:
            where, _, text = source.partition("  ")
            path, _, line = where.rpartition(":")
            source = f"{Path(path).name}:{line}" + (f"  {text}" if text else "")
        table.add_row(str(op.index), mark + op.op, op.phase, op.dtype,
                      f"{op.amax:.3g}" if math.isfinite(op.amax) else str(op.amax),
                      str(op.nonfinite), source)
    console.print(table)
    if result.dropped_ops:
        console.print(f"… {result.dropped_ops} more ops not shown")
    if result.error:
        console.print(f"[red]the replay raised {result.error}[/]")
    if result.first is not None:
        console.print(f"first non-finite value: [bold]{result.first.op}[/] ({result.first.phase})"
                      + (f" at {result.first.source}" if result.first.source else ""))
    else:
        console.print("every op produced finite values in this replay")
    for name, fmt in (("float16", get_format("float16")),):
        if result.output_amax > fmt.max:
            console.print(f"the output's amax {result.output_amax:.3g} exceeds {name}'s max "
                          f"{fmt.max:g}: it overflows when cast back to {name}")
