"""Warning rules: values at risk before anything is non-finite (near overflow, gradient
underflow, loss-scale trouble, loss spikes, input shifts)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from nanhunt.analyse.diagnose._base import (
    Context,
    _finding,
    _finite_pos,
    _n,
    _pct,
    _span,
    module_pattern,
    rule,
    scale_fractions,
)
from nanhunt.trace import Finding, LayerStats, StepRecord, Trace

# ----------------------------------------------------------------------------- warning rules


@dataclass
class _Risk:
    layer: LayerStats
    step: int
    amax: float  # unscaled
    headroom: float


def _at_risk_forward(ctx: Context) -> list[_Risk]:
    risks = []
    for layer in ctx.trace.layers:
        peak = ctx.forward_peak(layer)
        if peak is None:
            continue
        h = ctx.fmt.headroom_binades(peak[1])
        if h < ctx.th.near_max:
            risks.append(_Risk(layer, peak[0], peak[1], h))
    return risks


def _at_risk_backward(ctx: Context) -> list[_Risk]:
    risks = []
    for layer in ctx.trace.layers:
        peak = ctx.backward_peak(layer)
        if peak is None:
            continue
        h = ctx.fmt.headroom_binades(peak[1])
        if h < ctx.th.near_max:
            risks.append(_Risk(layer, peak[0], peak[1], h))
    return risks


def _innermost(ctx: Context, risks: list[_Risk], by_step: str) -> list[_Risk]:
    """Drop the failure's module and containers that only pass an at-risk value through."""
    f = ctx.failure
    culprit = ctx.layer(f.module) if f is not None and f.module else None
    kept: list[_Risk] = []
    seen_series: list[dict[int, float]] = []
    if culprit is not None:
        seen_series.append(getattr(culprit, by_step))
    for r in sorted(risks, key=lambda r: ctx.order.get(r.layer.module, 0)):
        name = r.layer.module
        if f is not None and f.module and (name == f.module or ctx.is_descendant(f.module, name)):
            continue
        if any(ctx.is_descendant(o.layer.module, name) for o in risks):
            continue
        series = getattr(r.layer, by_step)
        if any(series == s for s in seen_series):
            continue
        seen_series.append(series)
        if kept and _passes_through(ctx, kept[-1], r):
            continue
        kept.append(r)
    return kept


def _passes_through(ctx: Context, prev: _Risk, r: _Risk) -> bool:
    """A parameter-free module right after an at-risk one that does not raise its magnitude
    (an activation, dropout): the same risk, reported once."""
    adjacent = ctx.order.get(r.layer.module, -1) - ctx.order.get(prev.layer.module, -9) == 1
    no_params = not r.layer.param_amax_by_step and r.layer.param_grad is None
    other_kind = r.layer.type != prev.layer.type
    return adjacent and no_params and other_kind and r.amax <= prev.amax


def _group_risks(
    ctx: Context, risks: list[_Risk], *, what: str, wider: Callable[[LayerStats], bool]
) -> Iterator[Finding]:
    """One finding per module, or per class pattern where several siblings are at risk."""
    groups: dict[tuple[str, str], list[_Risk]] = {}
    for r in risks:
        groups.setdefault((r.layer.type, module_pattern(r.layer.module)), []).append(r)
    fmt = ctx.fmt
    for (type_name, pattern), members in groups.items():
        members.sort(key=lambda r: r.headroom)
        worst = members[0]
        score = min(9.0, 5.0 + 2.0 * (ctx.th.near_max - worst.headroom))
        if wider(worst.layer):
            score -= 1.0
        if worst.headroom < 0:
            verdict = f"exceeds {fmt.name}'s max ({fmt.max:g})"
        else:
            verdict = f"is {worst.headroom:.1f} binades below {fmt.name}'s max ({fmt.max:g})"
        evidence = [
            f"{r.layer.module}: {what} amax {_n(r.amax)} at step {r.step} "
            f"({r.headroom:.1f} binades of headroom)"
            for r in members[:3]
        ]
        if len(members) > 1:
            total = sum(
                1
                for layer in ctx.trace.layers
                if layer.type == type_name and module_pattern(layer.module) == pattern
            )
            message = (
                f"{len(members)} of {total} {type_name} modules matching {pattern}: "
                f"{what} amax {verdict} at worst"
            )
            module = pattern
        else:
            message = f"{worst.layer.module} ({type_name}): {what} amax {_n(worst.amax)} {verdict}"
            module = worst.layer.module
        if wider(worst.layer):
            evidence.append(
                f"recorded in {', '.join(worst.layer.dtypes)}: it would overflow if "
                f"run in {fmt.name}"
            )
        yield _finding(
            "warning",
            message,
            evidence,
            module=module,
            step=worst.step,
            score=score,
            data={
                "headroom": worst.headroom,
                "amax": worst.amax,
                "modules": [r.layer.module for r in members],
            },
        )


def _wider_than_target(ctx: Context) -> Callable[[LayerStats], bool]:
    """Whether a module ran in a wider format than the target while the run used the target."""
    used_target = ctx.fmt.name in ctx.trace.run.dtypes

    def wider(layer: LayerStats) -> bool:
        return used_target and bool(layer.dtypes) and ctx.fmt.name not in layer.dtypes

    return wider


@rule(id="near-overflow-forward", kind="overflow", needs=("layers",))
def near_overflow_forward(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """Modules whose forward amax came within two binades of the target max (sentinels ignored)."""
    risks = _innermost(ctx, _at_risk_forward(ctx), "forward_amax_by_step")
    for finding in _group_risks(ctx, risks, what="forward", wider=_wider_than_target(ctx)):
        finding.phase = "forward"
        yield finding


@rule(id="near-overflow-backward", kind="overflow", needs=("layers",))
def near_overflow_backward(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """Modules whose unscaled gradient amax came within two binades of the target max."""
    risks = _innermost(ctx, _at_risk_backward(ctx), "backward_amax_by_step")
    what = "unscaled gradient" if ctx.scaler else "gradient"
    for finding in _group_risks(ctx, risks, what=what, wider=_wider_than_target(ctx)):
        finding.phase = "backward"
        finding.score -= 0.5
        yield finding


def _vanished(ctx: Context) -> list[StepRecord]:
    """Clean steps whose whole gradient was exactly zero while the loss was not: every gradient
    flushed (zeros are not in the exponent histogram, so it cannot show them)."""
    steps = [s for s in ctx.clean_steps() if s.grad_norm is not None]
    zero = [s for s in steps if s.grad_norm == 0 and s.loss]
    uses_target = ctx.fmt.name in ctx.trace.run.dtypes
    return zero if uses_target and len(zero) >= 2 and len(zero) == len(steps) else []


@dataclass(frozen=True)
class _FlushSite:
    """Where gradients first flush to zero, in backward order."""

    module: str
    values: int
    flushed: int  # exactly 0 after the cast though non-zero before it (measured), or exact zeros
    subnormal: int
    source_zero: int | None  # zeros before the cast; None when no cast was measured
    evidence: str

    @property
    def flushed_fraction(self) -> float:
        nonzero = self.values - (self.source_zero or 0)
        return self.flushed / nonzero if nonzero else 0.0


def _flush_site(ctx: Context) -> _FlushSite | None:
    """The first module in backward order whose output gradient, in the target format, is
    mostly flushed or subnormal: measured at the down-cast where autocast computed it in a wider
    dtype (non-zero before, zero after), else the exact zeros of the stored gradient."""
    fmt, th = ctx.fmt, ctx.th
    layers = ctx.trace.layers
    def same_output(a: LayerStats, b: LayerStats) -> bool:
        sa, sb = (a.forward, a.backward), (b.forward, b.backward)
        return all(x is not None and y is not None and (x.numel, x.zero, x.underflow, x.amax)
                   == (y.numel, y.zero, y.underflow, y.amax) for x, y in zip(sa, sb))

    for layer in sorted(layers, key=lambda la: -ctx.order.get(la.module, 0)):
        if any(ctx.order.get(o.module, 0) < ctx.order.get(layer.module, 0)
               and same_output(o, layer) for o in layers):
            continue  # a container returning its child's output: the child is the site
        cc = layer.grad_cast
        if cc is not None and cc.values and cc.dtype == fmt.name:
            nonzero = cc.values - cc.source_zero
            if nonzero and (cc.flushed / nonzero >= th.flushed
                            or (cc.flushed + cc.subnormal) / nonzero >= th.underflow):
                return _FlushSite(
                    layer.module, cc.values, cc.flushed, cc.subnormal, cc.source_zero,
                    f"the gradient reaching {layer.module} (its output gradient, computed in "
                    f"{cc.source_dtype} and cast to {cc.dtype}) over the recorded steps: "
                    f"{nonzero:,} of {cc.values:,} values were non-zero in {cc.source_dtype} "
                    f"(largest {_n(cc.source_amax)}); the cast flushed {cc.flushed:,} "
                    f"({_pct(cc.flushed / nonzero)}) to exactly 0 and left {cc.subnormal:,} "
                    f"({_pct(cc.subnormal / nonzero)}) subnormal; {cc.source_zero:,} were "
                    "already 0 before the cast (reported apart, not flushed)",
                )
            continue
        b = layer.backward
        if b is None or not b.numel or b.dtype != fmt.name:
            continue
        sub = b.underflow
        if b.zero / b.numel >= th.flushed or (b.zero + sub) / b.numel >= th.underflow:
            normal = b.numel - b.zero - sub - b.nonfinite
            return _FlushSite(
                layer.module, b.numel, b.zero, sub, None,
                f"the gradient reaching {layer.module} ({b.dtype}, its output gradient) over "
                f"the recorded steps: {b.zero:,} of {b.numel:,} values ({_pct(b.zero / b.numel)}) "
                f"exactly 0, {sub:,} ({_pct(sub / b.numel)}) subnormal, {normal:,} normal (no "
                "wider value was cast here, so zeros that were zero already are included)",
            )
    return None


def _underflow(ctx: Context, message: Callable[[float, str], str]) -> Iterator[Finding]:
    """The gradient-underflow finding, worded by ``message(fraction lost, where)``."""
    for finding in _underflow_findings(ctx, message):
        site = _flush_site(ctx)
        if site is not None:
            finding.module = site.module
            finding.tensor = "output gradient"
            finding.message += (
                f"; in backward order they first flush at {site.module}: "
                f"{_pct(site.flushed_fraction)} of the gradient reaching it is flushed to zero"
            )
            finding.evidence.insert(0, site.evidence)
            finding.data["site"] = {
                "module": site.module, "values": site.values, "flushed": site.flushed,
                "subnormal": site.subnormal, "source_zero": site.source_zero,
                "flushed_fraction": site.flushed_fraction,
            }
        yield finding


def _underflow_findings(ctx: Context, message: Callable[[float, str], str]) -> Iterator[Finding]:
    fmt = ctx.fmt
    k, where = ctx.gradient_shift()
    zero = _vanished(ctx)
    if zero:
        losses = sorted(s.loss for s in zero if s.loss is not None)
        loss = _n(losses[0]) if losses[0] == losses[-1] else f"{_n(losses[0])} to {_n(losses[-1])}"
        yield _finding(
            "warning",
            message(1.0, where),
            [
                f"the gradient norm was exactly 0 in {_span([(s.index, 0.0) for s in zero])} "
                f"while the loss was {loss}: the gradients "
                f"flushed to zero in {fmt.name} (below {fmt.smallest_subnormal:.3g})"
            ],
            phase="backward",
            score=9.0,
            data={"k": k, "subnormal": 0.0, "flushed": 1.0, "normal": 0.0, "overflow": 0.0},
        )
        return
    hist, source = ctx.gradient_histogram()
    fr = scale_fractions(hist, fmt, k)
    if not fr.total or (fr.lost < ctx.th.underflow and fr.flushed < ctx.th.flushed):
        return
    yield _finding(
        "warning",
        message(fr.lost, where),
        [
            f"{source} {where}, of their {fr.total:,} non-zero values: {_pct(fr.subnormal)} "
            f"subnormal (below {fmt.smallest_normal:.3g}), {_pct(fr.flushed)} below "
            f"{fmt.smallest_subnormal:.3g} (would flush), {_pct(fr.normal)} normal; exact "
            "zeros have no binade and are counted at the module"
        ],
        phase="backward",
        score=min(9.0, 4.0 + 3.0 * fr.lost + 2.0 * fr.flushed),
        data={
            "k": fr.k,
            "subnormal": fr.subnormal,
            "flushed": fr.flushed,
            "normal": fr.normal,
            "overflow": fr.overflow,
        },
    )


@rule(id="gradient-underflow", kind="underflow", needs=("steps",))
def gradient_underflow(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """Without a loss scaler, most gradients are subnormal or flush to zero in the target."""
    if ctx.scaler:
        return
    yield from _underflow(
        ctx,
        lambda lost, where: (
            f"{_pct(lost)} of the gradients lose precision or vanish in "
            f"{ctx.fmt.name} {where}: scale the loss (GradScaler), or rescale the loss or the "
            "targets to a larger range"
        ),
    )


@rule(id="scale-too-low", kind="loss_scale", needs=("steps", "scaler"))
def scale_too_low(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """With GradScaler, the scale in effect leaves most gradients subnormal or flushed."""
    if not ctx.scaler:
        return
    yield from _underflow(
        ctx,
        lambda lost, where: (
            f"the loss scale is too low: {_pct(lost)} of the gradients lose "
            f"precision or vanish in {ctx.fmt.name} {where}"
        ),
    )


def unexplained_backoffs(events: list, after: float) -> list:
    """The backoffs after step ``after`` that take the scale below every level it held since
    then: each growth is GradScaler probing one binade up, and the skip it may cost brings the
    scale back to a level that was safe, at any growth_interval and however many clean steps
    the overflow waited for. Backoffs beyond the growths are the gradients outgrowing a scale
    that had fit: the scale's largest net fall, in binades, counts them."""
    level = low = 0
    out = []
    for e in sorted(events, key=lambda e: e.step):
        if e.step < after:
            continue
        level += 1 if e.event == "growth" else -1
        if e.event == "backoff" and level < low:
            low = level
            out.append(e)
    return out


@rule(id="scale-backoff", kind="loss_scale", needs=("scaler", "steps"))
def scale_backoff(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """GradScaler keeps backing off after its warm-up, or is still skipping at the end."""
    steps = [
        s
        for s in sorted(trace.steps, key=lambda s: s.index)
        if s.scale is not None and ctx.before_failure(s.index)
    ]
    if not steps:
        return
    warmup = 0
    while warmup < len(steps) and steps[warmup].skipped:
        warmup += 1
    recovered = warmup < len(steps)
    after = steps[warmup].index if recovered else math.inf
    events = sorted(
        (e for e in trace.scaler_events if ctx.before_failure(e.step)), key=lambda e: e.step
    )
    trouble = unexplained_backoffs(events, after)
    tail = 0
    while tail < len(steps) and steps[-1 - tail].skipped:
        tail += 1
    evidence = []
    if trouble:
        shown = ", ".join(str(e.step) for e in trouble[:8])
        evidence.append(f"backoffs that took the scale below every level it held after "
                        f"warm-up, at steps {shown}")
    if events:
        now = ctx.current_scale() or steps[-1].scale
        span = _span([(s.index, 0.0) for s in steps])
        evidence.append(f"scale went from {steps[0].scale:g} to {now:g} over {span}")
    if not recovered and len(steps) >= 2:
        yield _finding(
            "warning",
            f"GradScaler skipped every one of the {len(steps)} steps recorded",
            evidence,
            phase="loss_scaling",
            step=steps[0].index,
            score=7.0,
            data={"skipped": len(steps)},
        )
    elif tail >= 2:
        yield _finding(
            "warning",
            f"GradScaler is still skipping steps at the end: the last {tail} steps were skipped",
            evidence,
            phase="loss_scaling",
            step=steps[-tail].index,
            score=7.0,
            data={"skipped": tail},
        )
    elif len(trouble) >= ctx.th.backoffs:
        yield _finding(
            "warning",
            f"the loss scale backed off {len(trouble)} times more than it grew after "
            "warm-up: the gradients outgrew a scale that had fit",
            evidence,
            phase="loss_scaling",
            step=trouble[0].step,
            score=5.0,
            data={"backoffs": len(trouble)},
        )


#: A share of skipped steps that costs the run real updates (calibration or not).
SKIP_SHARE = 0.4


@rule(id="skip-streak", kind="loss_scale", needs=("scaler", "steps"))
def skip_streak(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """Skipped steps that cost something: an LR scheduler advancing on them, skips after the
    scale calibrated, or a large share of the run; calibration skips alone are a warning."""
    steps = [s for s in sorted(trace.steps, key=lambda s: s.index)
             if s.scale is not None and ctx.before_failure(s.index)]
    skipped = [s for s in steps if s.skipped]
    if not skipped or ctx.failure is not None:
        return
    calib = 0
    while calib < len(steps) and steps[calib].skipped:
        calib += 1
    # skips after calibration that GradScaler's own growth does not explain
    after = steps[calib].index if calib < len(steps) else math.inf
    later = unexplained_backoffs([e for e in trace.scaler_events if ctx.before_failure(e.step)],
                                 after)
    sched = [s for i, s in enumerate(steps[:-1])
             if s.skipped and s.lr is not None and steps[i + 1].lr is not None
             and steps[i + 1].lr != s.lr]
    share = len(skipped) / len(steps)
    evidence = [f"GradScaler skipped {len(skipped)} of {len(steps)} steps "
                f"({_pct(share)}): {', '.join(str(s.index) for s in skipped[:12])}"
                + (" ..." if len(skipped) > 12 else "")]
    if calib:
        evidence.append(f"calibration: the first {calib} steps were skipped while the scale "
                        f"fell from {steps[0].scale:g} to {steps[calib - 1].scale / 2:g}")
    hist, source = ctx.gradient_histogram()
    occupied = [e for e, c in hist.items() if c > 0]
    init_k = None
    # the scale the calibration settled at is direct evidence: the largest that did not overflow
    settled = steps[calib].scale if calib < len(steps) else None
    settled_k = math.floor(math.log2(settled)) if _finite_pos(settled) else None
    if settled_k is not None:
        init_k = settled_k
    if occupied:
        top = max(occupied)
        hist_k = ctx.fmt.max_binade - 2 - top
        init_k = hist_k if init_k is None else min(init_k, hist_k)
        k0 = round(math.log2(steps[0].scale))
        evidence.append(f"{source} of the applied steps: largest unscaled binade 2^{top}; at "
                        f"the initial scale 2^{k0} that is binade 2^{top + k0} "
                        f"({ctx.fmt.name}'s max binade is 2^{ctx.fmt.max_binade}): 2^{hist_k} "
                        "keeps two binades of headroom")
    if settled_k is not None:
        evidence.append(f"the scale settled at 2^{settled_k} after calibration: "
                        f"init_scale=2^{init_k} starts there")
    losses = [s.loss for s in steps if s.loss is not None and math.isfinite(s.loss)]
    summed = bool(losses) and statistics.median(losses) >= 1e3
    if summed:
        evidence.append(
            f"the loss is {_n(statistics.median(losses))} per step: a loss summed over many "
            "elements (reduction=\"sum\") multiplies every gradient by their count; "
            "reduction=\"mean\" keeps gradients (and the scale that fits them) independent of "
            "the batch and image size")
    harm = []
    if sched:
        harm.append(f"the LR scheduler advanced on {len(sched)} skipped steps (lr "
                    f"{_n(sched[0].lr)} -> {_n(steps[steps.index(sched[-1]) + 1].lr)}): its "
                    "warm-up was spent on updates that never happened (torch warns "
                    "\"lr_scheduler.step() before optimizer.step()\")")
    if len(later) >= ctx.th.backoffs:
        harm.append(f"{len(later)} skips after the scale calibrated took it below every "
                    "level it had held (backoffs beyond its growths: the gradients outgrew "
                    "a scale that had fit)")
    if calib == len(steps) and calib >= 5:
        harm.append(f"every one of the {calib} steps was skipped: no update was applied (the "
                    f"scale fell from {steps[0].scale:g} to {steps[-1].scale:g} and the gradients "
                    "still overflowed)")
    elif share >= SKIP_SHARE and len(skipped) >= 5:
        # calibration is normal, but not when it costs a large share of the run's updates (an
        # init_scale far above what the gradients allow: a summed loss, a Megatron-size scale)
        after = len(skipped) - calib
        harm.append(f"{_pct(share)} of the run's steps were skipped ({calib} while the scale "
                    "calibrated" + (f", {after} after it" if after else "") + "): those "
                    "updates never happened")
    data = {"skipped": len(skipped), "steps": len(steps), "calibration": calib,
            "scheduler_steps": [s.index for s in sched], "after_calibration": len(later),
            "share": share, "summed_loss": summed, "init_k": init_k}
    if harm:
        yield _finding(
            "error",
            "skipped steps cost this run updates: " + "; ".join(harm),
            evidence,
            phase="loss_scaling",
            step=skipped[0].index,
            score=7.0,
            data=data,
        )
    elif calib > 2:
        yield _finding(
            "warning",
            f"GradScaler skipped the first {calib} steps calibrating the loss scale"
            + (f": init_scale=2^{init_k} avoids them" if init_k is not None else ""),
            evidence,
            phase="loss_scaling",
            step=skipped[0].index,
            score=4.0,
            data=data,
        )


@rule(id="input-range-shift", kind="bad_input", needs=("layers",))
def input_range_shift(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """The first module's output range jumped while its weights held still: the batch changed."""
    first = trace.layers[0]
    points = sorted(
        (s, v)
        for s, v in first.forward_amax_by_step.items()
        if _finite_pos(v) and (ctx.fail_step is None or s <= ctx.fail_step)
    )
    params = first.param_amax_by_step
    worst = None
    for i in range(2, len(points)):
        window = points[max(0, i - ctx.th.window) : i]
        med = statistics.median(v for _, v in window)
        step, v = points[i]
        if not (med > 0 and v / med >= ctx.th.input_jump):
            continue
        # the weights in effect over the window and at this step: the updates of steps
        # window[0] .. step - 1; with fewer than two of them, nothing says they held still
        weights = [w for s, w in params.items() if window[0][0] <= s < step and _finite_pos(w)]
        if params and (len(weights) < 2 or max(weights) / min(weights) >= ctx.th.weight_growth):
            continue
        if worst is None or v / med > worst[2]:
            worst = (step, v, v / med, med)
    if worst is None:
        return
    step, v, ratio, med = worst
    evidence = [
        f"{first.module} ({first.type}) output amax {_n(v)} at step {step}, "
        f"{ratio:.3g}x its median {_n(med)} before"
    ]
    if first.param_amax_by_step:
        evidence.append(
            f"its weights held still (largest |weight| "
            f"{_n(max(first.param_amax_by_step.values()))})"
        )
    yield _finding(
        "warning",
        f"the batch at step {step} is on a different scale: "
        f"{first.module}'s output jumped {ratio:.3g}x with unchanged weights",
        evidence,
        phase="data",
        step=step,
        module=first.module,
        score=6.0,
        data={"ratio": ratio, "amax": v, "median": med},
    )
