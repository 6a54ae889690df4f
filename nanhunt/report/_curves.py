"""What the renderers show for a failure without a NaN (``analyse/diagnose/curves.py``): the
finding's step, the loss and the culprit's signal on the same axis of steps, as sparklines
(terminal) or series (HTML charts). Torch-free; reads only the trace."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nanhunt.trace import Finding, Trace

__all__ = ["CURVE_RULES", "CurveView", "curve_view", "sparkline", "terminal_lines"]

CURVE_RULES = ("logit-growth", "loss-divergence", "loss-spike", "loss-stall")
_BARS = "▁▂▃▄▅▆▇█"


@dataclass
class CurveView:
    finding: Finding
    step: int | None  # the step the finding names (the spike, the onset, the crossing)
    signal: str  # what the culprit series is: "attention logits in blocks.1.attn"
    points: list[tuple[int, float]]  # the culprit's series (empty when none was recorded)
    groups: dict[str, list[tuple[int, float]]]  # update-to-weight ratio by param group


def curve_view(trace: Trace) -> CurveView | None:
    """The first loss-curve finding (the diagnosis, else the worst warning) and its series."""
    found = [f for f in [trace.diagnosis, *trace.warnings]
             if f is not None and f.rule in CURVE_RULES]
    if not found:
        return None
    f = found[0]
    sig = f.data.get("signal")
    layer = next((lay for lay in trace.layers if f.module and lay.module == f.module), None)
    label, points = "", []
    if layer is not None:
        if sig == "attention_logit":
            label, by = f"largest attention logit in {layer.module}", layer.logit_amax_by_step
        elif sig == "param_grad":
            label, by = (f"largest parameter gradient of {layer.module} (as stored)",
                         layer.param_grad_amax_by_step)
        else:
            label, by = f"largest output of {layer.module}", layer.forward_amax_by_step
        points = sorted((s, v) for s, v in by.items() if math.isfinite(v))
    groups: dict[str, list[tuple[int, float]]] = {}
    for st in sorted(trace.signals, key=lambda s: s.step):
        for g in st.groups:
            r = g.update_ratio
            if r is not None and math.isfinite(r):
                groups.setdefault(g.group, []).append((st.step, r))
    return CurveView(f, f.step, label, points, groups)


def sparkline(values: list[float], width: int = 48) -> str:
    """Bars for ``values`` (at most ``width``: longer series are sampled evenly), on a log scale
    when they span more than two decades."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return ""
    if len(values) > width:
        values = [values[round(i * (len(values) - 1) / (width - 1))] for i in range(width)]
    log = min(vals) > 0 and max(vals) / min(vals) > 100
    tr = (lambda v: math.log10(v)) if log else (lambda v: v)
    lo, hi = tr(min(vals)), tr(max(vals))
    out = []
    for v in values:
        if v is None or not math.isfinite(v):
            out.append("×")
            continue
        k = 0 if hi == lo else round((tr(v) - lo) / (hi - lo) * (len(_BARS) - 1))
        out.append(_BARS[k])
    return "".join(out)


def terminal_lines(trace: Trace) -> list[str]:
    """One sparkline of the loss and one of the culprit's series, on the same steps."""
    view = curve_view(trace)
    steps = sorted((s.index, s.loss) for s in trace.steps if s.loss is not None)
    if view is None or len(steps) < 2:
        return []
    first, last = steps[0][0], steps[-1][0]
    at = f", step {view.step} marked by the finding" if view.step is not None else ""
    lines = [f"loss      {sparkline([v for _, v in steps])}  steps {first}-{last}{at}"]
    pts = [(s, v) for s, v in view.points if first <= s <= last]
    if len(pts) >= 2:
        lines.append(f"signal    {sparkline([v for _, v in pts])}  {view.signal}: "
                     f"{pts[0][1]:.3g} -> {max(v for _, v in pts):.3g}")
    group = view.finding.data.get("group")
    if group in view.groups and len(view.groups[group]) >= 2:
        g = view.groups[group]
        lines.append(f"update    {sparkline([v for _, v in g])}  update/weight ratio of "
                     f"{group}: median {sorted(v for _, v in g)[len(g) // 2]:.2g}")
    return lines
