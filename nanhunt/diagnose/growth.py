"""Growth rules: weights or gradients growing step over step (a learning rate too high,
exploding gradients)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterator

from ..trace import Finding, LayerStats, Trace
from ._base import (
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
from .classify import (
    _is_weight_growth,
)

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


@rule(id="weight-growth", kind="lr_too_high", needs=("param_amax",))
def weight_growth(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """Weights grew fast step over step (largest |weight| after each update), before a failure
    or in a run still finite."""
    f = ctx.failure
    if f is not None and f.phase in ("data", "optimizer"):
        return
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


def _grad_site(ctx: Context) -> tuple[str, list[tuple[int, float]]] | None:
    """The module whose own parameter gradients grew most over the applied steps (with one
    applied step: the largest), with its unscaled series; a recurrent cell's inner layer is
    named by the outermost module called as often as it (the cell, not its Linear)."""
    cands = []
    for layer in ctx.trace.layers:
        pts = []
        for s, v in sorted(layer.param_grad_amax_by_step.items()):
            rec = ctx.steps.get(s)
            if _finite_pos(v) and rec is not None and not rec.skipped and ctx.before_failure(s):
                pts.append((s, v / ctx.scale_at(s)))
        if pts:
            cands.append((layer, pts))
    if not cands:
        return None

    def growth(pts: list[tuple[int, float]]) -> float:
        best = 1.0
        for i in range(1, len(pts)):
            low = min(v for _, v in pts[:i])
            best = max(best, pts[i][1] / low)
        return best

    if any(len(p) > 1 for _, p in cands):
        layer, pts = max(cands, key=lambda c: (growth(c[1]), -ctx.order.get(c[0].module, 0)))
    else:
        layer, pts = max(cands, key=lambda c: c[1][-1][1])
    ancestors = [o.module for o in ctx.trace.layers if o.module
                 and ctx.is_descendant(layer.module, o.module) and o.calls >= layer.calls]
    # the outermost module called as often (per step) as the site: the recurrent cell
    return min(ancestors, key=len, default=layer.module), pts


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
    site = _grad_site(ctx)
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
    # orders of magnitude is a problem even while the loss is finite and GradScaler skips
    severe = factor >= ORDERS if how == "spike" else data["total"] >= ORDERS
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
