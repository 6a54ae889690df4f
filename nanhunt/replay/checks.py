"""Replay checks: each recommendation a replay can check (a float32 region with the cast back,
a clamp, a floor on an op's input, an eps) is replayed with the fix applied. A finite replay
labels it "checked by replaying the culprit", never "verified": only a re-run of the training
(:mod:`nanhunt.experiment.verify`) verifies a fix."""

from __future__ import annotations

import fnmatch
from typing import Any

import torch

from nanhunt.capture.state import OptimizerSnapshot, Snapshot
from nanhunt.formats import get_format
from nanhunt.replay.module import DTYPES, map_floats, replay, tensors
from nanhunt.replay.ops import ReplayResult
from nanhunt.replay.optimizer import replay_optimizer
from nanhunt.trace import Trace

__all__ = ["check", "check_optimizer", "why_not_checked"]

def check(trace: Trace, snap: Snapshot) -> None:
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
            _check_fp32(rec, snap, fmt)
        elif rec.type == "clamp":
            _check_clamp(rec, snap)
        elif rec.type == "eps":
            _check_eps(rec, snap)
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


def _check_fp32(rec: Any, snap: Snapshot, fmt: Any) -> None:
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
                                DTYPES.get(cast_to) if full == last else None)

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
        device = next((t.device.type for t in tensors(args)), "cpu")
        with torch.autocast(device, enabled=False):
            out = forward(*map_floats(args, lambda t: t.float()),
                          **map_floats(kwargs, lambda t: t.float()))
        return map_floats(out, lambda t: t.to(cast_to)) if cast_to else out

    module.forward = fp32_forward


def _check_clamp(rec: Any, snap: Snapshot) -> None:
    where = rec.data.get("where", "output")
    value = float(rec.value) if isinstance(rec.value, (int, float)) else None
    if where == "output":
        bound = float(rec.data.get("bound", value))
        r = replay(snap, output_fix=lambda out: map_floats(
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


def _check_eps(rec: Any, snap: Snapshot) -> None:
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


def why_not_checked(kind: str, *, captured: bool = True) -> str:
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


def check_optimizer(trace: Trace, snap: OptimizerSnapshot) -> None:
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
