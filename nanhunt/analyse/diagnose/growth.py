"""Growth rules: weights or gradients growing step over step (a learning rate too high,
exploding gradients)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

from nanhunt.analyse.diagnose._base import (
    ORDERS,
    Context,
    Growth,
    Thresholds,
    _finding,
    _finite_pos,
    _growth,
    _n,
    _series,
    _span,
    rule,
)
from nanhunt.analyse.diagnose.classify import (
    _is_weight_growth,
)
from nanhunt.analyse.diagnose.shared import grad_site, is_recurrent
from nanhunt.trace import Finding, LayerStats, Trace

# ----------------------------------------------------------------------------- growth rules
# These are errors when a failure follows the growth, warnings when the run is still finite.


def _sustained(points: list[tuple[int, float]], th: Thresholds) -> bool:
    """Growth over several steps, not one jump: without its largest step-to-step ratio the
    series still grows by the threshold per step (a gradient spike moves weights once)."""
    pts = [v for _, v in points if _finite_pos(v)]
    if len(pts) < 3:
        return True
    ratios = sorted(b / a for a, b in itertools.pairwise(pts))[:-1]
    return math.prod(ratios) ** (1 / len(ratios)) >= th.weight_growth


def _weight_growth(ctx: Context) -> tuple[LayerStats, Growth, list[tuple[int, float]]] | None:
    th = ctx.th
    best = None
    for layer in ctx.trace.layers:
        points = ctx.pre_points(layer.param_amax_by_step)[-th.window :]
        g = _growth(points)
        if g is None or not _is_weight_growth(g, th) or not _sustained(points, th):
            continue
        if best is None or g.per_step > best[1].per_step:
            best = (layer, g, points)
    return best


#: Optimizers whose update per weight is about lr whatever the gradient's size (m / sqrt(v)):
#: clipping the gradient does not shrink their steps, only a lower learning rate does.
ADAPTIVE = frozenset({"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
                      "Adadelta", "SparseAdam", "FusedAdam", "Lion", "Adafactor"})

#: Change of a weight per step, relative to its size, that an adaptive optimizer's lr is cut to.
ADAPTIVE_UPDATE = 1e-3


@dataclass
class _AdaptiveGrowth:
    layer: LayerStats
    points: list[tuple[int, float]]
    increment: float  # median growth of the largest |weight| per applied step
    optimizer: str
    lr: float
    factor: float  # the lr cut that brings the change per step to ADAPTIVE_UPDATE
    grown: int = 0  # layers whose weights grew so
    weighted: int = 0  # layers whose weights were recorded over enough steps


def _adaptive_growth(ctx: Context) -> _AdaptiveGrowth | None:
    """Weights that grow by about the learning rate at every applied step under an adaptive
    optimizer: linear growth, which the geometric test misses, with each step's change as large
    as lr (Adam's step size) and the weights several times their first size."""
    opts = [o for o in ctx.trace.optimizers if o.type in ADAPTIVE and _finite_pos(o.lr)]
    if not opts:
        return None
    opt = max(opts, key=lambda o: o.lr or 0.0)
    lr = float(opt.lr or 0.0)
    best = None
    weighted = grown = 0
    for layer in ctx.trace.layers:
        # the whole series for the growth (linear growth slows in ratio as the weights grow),
        # the last window for the step size
        points = ctx.pre_points(layer.param_amax_by_step)
        vals = [v for _, v in points]
        if len(vals) < 4:
            continue
        weighted += 1
        if vals[-1] < 2 * vals[0] or vals[-1] < ctx.th.weight_floor:
            continue
        incs = [b - a for a, b in itertools.pairwise(vals[-ctx.th.window:])]
        if sum(i > 0 for i in incs) * 4 < 3 * len(incs):
            continue
        inc = statistics.median(incs)
        if inc < 0.25 * lr:
            continue
        grown += 1
        if best is None or vals[-1] / vals[0] > best.points[-1][1] / best.points[0][1]:
            size = statistics.median(vals)
            f = ADAPTIVE_UPDATE * size / inc
            factor = max(1e-4, min(0.1, 10.0 ** math.floor(math.log10(f))))
            best = _AdaptiveGrowth(layer, points, inc, opt.type, lr, factor)
    if best is not None:
        best.grown, best.weighted = grown, weighted
    return best


def _adaptive_finding(ctx: Context, a: _AdaptiveGrowth) -> Finding:
    f = ctx.failure
    pts = a.points
    evidence = [
        f"{a.layer.module}'s largest |weight| by applied step ({_span(pts)}): {_series(pts)}: "
        f"+{_n(a.increment)} a step, the size of {a.optimizer}'s update at lr={a.lr:g} "
        "(it moves each weight by up to lr per step, whatever the gradient's size)",
        f"the weights are {pts[-1][1] / pts[0][1]:.3g}x their size at step {pts[0][0]}: "
        "clipping the gradient norm does not shrink an adaptive optimizer's steps",
    ]
    norms = ctx.grad_norms(include_failure=False)
    if norms:
        evidence.append(f"gradient norm by step ({_span(norms[-6:])}): {_series(norms)}")
    then = f" before the failure at step {f.step}" if f is not None else ""
    # no value went non-finite, but the run pays already: its loss stayed many times its first
    # value for three steps or more
    losses = [(st.index, st.loss) for st in sorted(ctx.trace.steps, key=lambda st: st.index)
              if st.loss is not None and math.isfinite(st.loss) and st.loss > 0
              and ctx.before_failure(st.index)]
    high = [w for w in zip(losses, losses[1:], losses[2:])
            if losses and min(v for _, v in w) >= ctx.th.loss_spike * losses[0][1]]
    if high:
        peak = max((p for w in high for p in w), key=lambda p: p[1])
        evidence.append(f"the loss rose from {_n(losses[0][1])} (step {losses[0][0]}) to "
                        f"{_n(peak[1])} (step {peak[0]}) and stayed above "
                        f"{ctx.th.loss_spike:g}x its first value for three steps or more")
    # Adam moves every weight by lr: when most layers grew, the lr is no one layer's problem
    everywhere = a.grown >= 3 or (a.weighted >= 2 and a.grown * 2 >= a.weighted)
    who = (f"the weights of {a.grown} of {a.weighted} layers (most: {a.layer.module}, "
           if everywhere else f"{a.layer.module}'s weights (")
    return _finding(
        "error" if f is not None or high else "warning",
        f"{who}{_n(pts[0][1])} -> {_n(pts[-1][1])} over {_span(pts)}) grew by about "
        f"lr={a.lr:g} at every step{then}: the learning rate is too high for {a.optimizer}",
        evidence,
        phase="optimizer",
        step=pts[-1][0],
        module=None if everywhere else a.layer.module,
        score=6.0,
        data={"growth_per_step": (pts[-1][1] / pts[0][1]) ** (1 / max(1, len(pts) - 1)),
              "from": pts[0][1], "to": pts[-1][1], "lr_factor": a.factor,
              "increment": a.increment, "optimizer": a.optimizer, "lr": a.lr},
    )


@rule(id="weight-growth", kind="lr_too_high", needs=("param_amax",))
def weight_growth(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """Weights grew fast step over step (largest |weight| after each update), before a failure
    or in a run still finite."""
    f = ctx.failure
    if f is not None and f.phase in ("data", "optimizer"):
        return
    adaptive = _adaptive_growth(ctx)
    if adaptive is not None:  # Adam's steps are lr whatever the gradients do
        yield _adaptive_finding(ctx, adaptive)
        return
    if _recurrent_explosion(ctx) is not None:
        return  # the weights grew because the gradients through time did: exploding-gradient's
    found = _weight_growth(ctx)
    if found is None:
        return
    layer, g, points = found
    evidence = [
        f"{layer.module}'s largest |weight| by step ({_span(points)}): {_series(points)}; "
        f"about {g.per_step:.3g}x a step"
    ]
    norms = ctx.grad_norms(include_failure=False)
    if norms:
        evidence.append(f"gradient norm by step ({_span(norms[-6:])}): {_series(norms)}")
    severity = "error" if f is not None else "warning"
    then = f" before the failure at step {f.step}" if f is not None else ""
    yield _finding(
        severity,
        f"{layer.module}'s weights grew about {g.per_step:.3g}x a step over {_span(points)}"
        f"{then}: the learning rate is too high for them",
        evidence,
        step=g.last_step,
        module=layer.module,
        score=6.0,
        data={"growth_per_step": g.per_step, "from": g.first, "to": g.last},
    )


def _recurrent_explosion(ctx: Context) -> str | None:
    """The module, when the gradient norm exploded (one order of magnitude or more) and it
    grows in a recurrent module: an RNN/LSTM/GRU, or a cell with parameters called several
    times a step (a hand-written loop through time). Gradients through time explode by
    themselves (the recurrent weight's gain, step after step); the weights an optimizer like
    SGD then grows are their consequence, and clipping, not a lower lr, is the fix."""
    found = _grad_explosion(ctx)
    if found is None:
        return None
    how, points, factor = found
    if how == "growth":
        g = _growth(points, from_min=True)
        factor = g.total if g is not None else 0.0
    if factor < ctx.th.grad_spike:
        return None
    site = grad_site(ctx)
    if site is None:
        return None
    layer = ctx.layer(site[0])
    return site[0] if layer is not None and is_recurrent(ctx, layer) else None


def _explosion_harm(ctx: Context, step: int) -> str | None:
    """What the run paid within two steps of a gradient explosion at ``step``: a loss that
    jumped far above its median, or GradScaler skipping steps after applying updates (not the
    calibration skips at the start)."""
    steps = sorted(ctx.trace.steps, key=lambda s: s.index)
    near = [s for s in steps if step <= s.index <= step + 2]
    before = [s.loss for s in steps if s.index < step and s.loss is not None
              and math.isfinite(s.loss)]
    applied_before = any(not s.skipped for s in steps if s.index < step)
    grew = {e.step for e in ctx.trace.scaler_events if e.event == "growth"}
    # (a skip right after GradScaler raised the scale is how it probes: not a cost)
    skipped = [s.index for s in near if s.skipped and s.index > step and s.index - 1 not in grew]
    if skipped and applied_before:
        return (f"GradScaler skipped step{'s' if len(skipped) > 1 else ''} "
                f"{', '.join(map(str, skipped))} right after it: the scaled gradients "
                "overflowed although earlier steps at the same scale had fit")
    if len(before) >= 2:
        med = statistics.median(before)
        high = [(s.index, s.loss) for s in near if s.loss is not None and math.isfinite(s.loss)
                and med > 0 and s.loss >= ctx.th.loss_spike * med]
        if high:
            i, v = high[0]
            return (f"the loss jumped to {_n(v)} at step {i}, {v / med:.3g}x its median "
                    f"({_n(med)}) before")
    return None


def _grad_explosion(ctx: Context) -> tuple[str, list[tuple[int, float]], float] | None:
    """("growth" | "spike", the norms judged, the factor) or None."""
    th = ctx.th
    norms = ctx.grad_norms()
    if len(norms) < 3:
        return None
    window = norms[-th.window :]
    g = _growth(window, from_min=True)
    rises = sum(b[1] > a[1] for a, b in itertools.pairwise(window))
    if (
        g is not None
        and g.steps >= 2
        and g.total >= th.grad_growth
        and rises * 3 >= 2 * (len(window) - 1)
    ):
        return "growth", window, g.per_step
    for i in range(len(norms) - 1, 2, -1):
        prev = [v for _, v in norms[max(0, i - th.window) : i]]
        med = statistics.median(prev)
        if med > 0 and norms[i][1] >= th.grad_spike * med:
            return "spike", norms[max(0, i - th.window) : i + 1], norms[i][1] / med
    return None


@rule(id="exploding-gradient", kind="exploding_gradient", needs=("grad_norm",))
def exploding_gradient(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """Gradient norms grew step over step (or spiked far above their median)."""
    found = _grad_explosion(ctx)
    if found is None:
        return
    how, points, factor = found
    f = ctx.failure
    if how == "growth":
        g = _growth(points, from_min=True)
        assert g is not None
        message = (
            f"the gradient norm grew {g.total:.3g}x from {_n(g.first)} (step "
            f"{g.first_step}) to {_n(g.last)} (step {g.last_step}), about "
            f"{g.per_step:.3g}x a step"
        )
        data = {"growth_per_step": g.per_step, "total": g.total, "from_step": g.first_step}
        evidence = [f"gradient norm by step ({_span(points)}): {_series(points, 8)}"]
    else:
        step, value = points[-1]
        prev = [v for _, v in points[:-1]]
        message = (
            f"the gradient norm spiked to {_n(value)} at step {step}, {factor:.3g}x the "
            f"median ({_n(statistics.median(prev))}) of the {len(prev)} steps before"
        )
        data = {"spike": factor, "from_step": step}
        evidence = [f"gradient norm by step ({_span(points)}): {_series(points, 8)}"]
    if f is not None:
        message += f", before the failure at step {f.step}"
    site = grad_site(ctx)
    module = None
    if site is not None:
        module = site[0]
        message += f"; the gradient grows in {module}"
        evidence.append(f"{module}'s largest unscaled parameter gradient by step "
                        f"({_span(site[1])}): {_series(site[1], 8)}")
    skipped = [s.index for s in trace.steps if s.skipped and ctx.before_failure(s.index)]
    if skipped:
        evidence.append(f"GradScaler skipped {len(skipped)} steps whose scaled gradients "
                        f"overflowed ({_span([(i, 0.0) for i in skipped])}): the loss stayed "
                        "finite, the gradients did not")
    # orders of magnitude is a problem even while the loss is finite and GradScaler skips; one
    # order is when the run pays for it at once (a loss spike, skips after applied steps)
    severe = factor >= ORDERS if how == "spike" else data["total"] >= ORDERS
    harm = _explosion_harm(ctx, points[-1][0])
    if harm and not severe and (factor if how == "spike" else data["total"]) >= ctx.th.grad_spike:
        severe = True
        evidence.append(harm)
    last = max((s.index for s in trace.steps), default=None)
    if trace.partial and points[-1][0] == last:
        severe = False  # the step a crash interrupted: its gradients may be half-reduced
    yield _finding(
        "error" if (f is not None and f.phase != "data") or (f is None and severe) else "warning",
        message,
        evidence,
        phase="backward",
        step=points[-1][0],
        module=module,
        score=6.0,
        data=data,
    )
