"""What the diagnosis rules share with each other: evidence helpers that more than one rule
module reads. The rule modules import this one (and ``_base``, the context and the registry),
never each other's private names, so the package's imports run one way."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nanhunt.analyse.diagnose._base import Context, _finite_pos
from nanhunt.formats import FORMATS, NumberFormat
from nanhunt.trace import LayerStats, OpRecord

__all__ = [
    "RECURRENT_TYPES",
    "VanishedEps",
    "grad_site",
    "is_recurrent",
    "op_name",
    "rounded",
    "short_source",
    "vanished_eps",
]


def rounded(x: float, fmt: NumberFormat) -> float:
    """``x`` rounded to the nearest value of ``fmt`` (ties to even), inf beyond its max."""
    if x == 0 or not math.isfinite(x):
        return x
    a = abs(x)
    if a < fmt.smallest_normal:
        quantum = fmt.smallest_subnormal
    else:
        quantum = 2.0 ** (math.floor(math.log2(a)) - fmt.mantissa_bits)
    r = round(a / quantum) * quantum  # Python's round() is round-half-to-even
    if r > fmt.max:
        r = math.inf
    return math.copysign(r, x)


_EPS_CONSUMERS = frozenset({"rsqrt", "sqrt", "div", "reciprocal", "pow", "addcdiv", "log"})


_ADDS = frozenset({"add"})


def op_name(op: str) -> str:
    parts = [p for p in op.replace("::", ".").split(".") if p not in ("aten", "default", "Tensor",
                                                                     "Scalar", "out")]
    return parts[0].rstrip("_") if parts else op


@dataclass(frozen=True)
class VanishedEps:
    add: OpRecord  # the op that added the eps
    eps: float
    fmt: NumberFormat
    consumer: OpRecord  # the first non-finite op


def vanished_eps(ops: list[OpRecord], phase: str) -> VanishedEps | None:
    """The first non-finite op of a replay divides by (or roots) a sum to which a positive
    constant that is 0 in that op's format was added just before: an eps that vanished."""
    first = next((o for o in ops if o.first_nonfinite and o.phase == phase), None)
    if first is None or op_name(first.op) not in _EPS_CONSUMERS:
        return None
    before = [o for o in ops if o.phase == phase and o.index < first.index]
    for o in reversed(before[-12:]):
        if op_name(o.op) not in _ADDS:
            continue
        fmt = FORMATS.get(o.dtype)
        if fmt is None or fmt.name == "float32":
            continue
        for s in o.scalars:
            if 0 < s < fmt.smallest_normal and rounded(s, fmt) == 0:
                return VanishedEps(o, s, fmt, first)
    return None


def short_source(source: str) -> str:
    path, _, line = source.rpartition(":")
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    return f"{name}:{line}" if path else source


def grad_site(ctx: Context) -> tuple[str, list[tuple[int, float]]] | None:
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
        # growth made in a module shows in its own gradients and in those of every module
        # upstream of it (they receive its gradient): of the modules that grew about as much as
        # the most, the one nearest the loss (last in forward order) is where it starts
        top = max(growth(p) for _, p in cands)
        strong = [c for c in cands if math.log(growth(c[1])) >= 0.5 * math.log(top)]
        # ... unless one of them applies its weights again and again in a step: a recurrence
        # multiplies the gradient by its own Jacobian at each call, so it is the amplifier, and
        # a feed-forward layer after it (a readout head) only follows its input. Choosing by
        # "nearest the loss" alone flips on the float rounding of a chaotic run when the head's
        # growth sits near the cut; the recurrence with the most growth does not.
        loops = [c for c in strong if is_recurrent(ctx, c[0])]
        if loops:
            layer, pts = max(loops, key=lambda c: growth(c[1]))
        else:
            layer, pts = max(strong, key=lambda c: ctx.order.get(c[0].module, -1))
    else:
        layer, pts = max(cands, key=lambda c: c[1][-1][1])
    ancestors = [o.module for o in ctx.trace.layers if o.module
                 and ctx.is_descendant(layer.module, o.module) and o.calls >= layer.calls]
    # the outermost module called as often (per step) as the site: the recurrent cell
    return min(ancestors, key=len, default=layer.module), pts


RECURRENT_TYPES = ("RNN", "LSTM", "GRU")


def is_recurrent(ctx: Context, layer: LayerStats) -> bool:
    """An RNN/LSTM/GRU, or a module with parameters called several times a step (a cell in a
    hand-written loop through time), or one inside such a module."""
    # calls count every traced step, while the by-step series keep only the last few
    steps = max(1, sum(1 for s in ctx.trace.steps if s.traced is not False),
                len(layer.forward_amax_by_step))
    outer = [o for o in ctx.trace.layers if o.module and o.calls >= layer.calls
             and (o is layer or ctx.is_descendant(layer.module, o.module))]
    return any(any(w in o.type for w in RECURRENT_TYPES) or o.calls >= 2 * steps for o in outer)
