"""Classification of a first failure by phase: one classifier each for forward, backward
and optimizer failures decides which explanation holds; each rule reports the class it owns."""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass
from typing import Any

from nanhunt.analyse.diagnose._base import (
    _NAN_OPS,
    _OP_NOISE,
    _OVERFLOW_OPS,
    Context,
    Growth,
    Thresholds,
    _counts,
    _finite_pos,
    _growth,
    _n,
    _narrow,
    _pct,
    _series,
    _span,
    _trend,
    eps_in_format,
    is_loss_type,
    is_norm_type,
    is_sentinel,
)
from nanhunt.analyse.diagnose.shared import vanished_eps
from nanhunt.formats import FORMATS, NumberFormat
from nanhunt.trace import Failure, Trace

# ----------------------------------------------------------------------------- classification
# Forward, backward and optimizer failures each have several explanations; one classifier per
# phase decides, and each rule reports the class it owns.


@dataclass
class _Class:
    name: str  # overflow | nan_op | loss_nan_op | norm_underflow | lr | eps
    fmt: NumberFormat  # the format the failing value lives in
    evidence: list[str]
    data: dict[str, Any]


def failure_op(trace: Trace) -> str | None:
    """The op that made the first non-finite value, as the replay named it, without namespace
    and overload (``aten.log.default`` and ``aten::log`` -> ``log``); None without a replay."""
    f = trace.first_failure
    op = f.op if f is not None else None
    if not op:
        op = next((o.op for o in trace.ops if o.first_nonfinite), None)
    if not op:
        return None
    parts = [p for p in op.replace("::", ".").split(".") if p not in _OP_NOISE]
    return parts[0] if parts else None


def is_softmax(op: str | None) -> bool:
    """An op that normalises a row by its exponentials (softmax, log_softmax, attention)."""
    return bool(op) and ("softmax" in op or op.startswith("_scaled_dot_product")
                         or op == "scaled_dot_product_attention")


def _op_input_amax(ctx: Context) -> float | None:
    """Largest finite result of the replayed ops before the first non-finite one."""
    phase = ctx.failure.phase if ctx.failure is not None else "forward"
    vals = []
    for o in ctx.trace.ops:
        if o.phase != phase:
            continue
        if o.first_nonfinite:
            break
        if _finite_pos(o.amax):
            vals.append(o.amax)
    return max(vals) if vals else None


def _where(f: Failure) -> str:
    """``fc's output``; a parameter's name already says whose it is."""
    if not f.module or f.tensor.startswith(f.module + "."):
        return f.tensor
    return f"{f.module}'s {f.tensor}"


def _of(numel: int) -> str:
    return "1 value" if numel == 1 else f"{numel} values"


def _describe_failure(f: Failure, fmt: NumberFormat) -> str:
    s = f.stats
    text = f"step {f.step}: {_where(f)} ({s.dtype}) held {_counts(s)} of {_of(s.numel)}"
    if s.amax > 0:
        text += f"; its finite values reach {_n(s.amax)} ({fmt.name} max {fmt.max:g})"
    return text


def _forward_class(ctx: Context) -> _Class:
    return ctx.cached("forward", lambda: _classify_forward(ctx))


def _classify_forward(ctx: Context) -> _Class:
    f = ctx.failure
    assert f is not None
    th = ctx.th
    s = f.stats
    fmt = ctx.format_of(s.dtype)
    layer = ctx.layer(f.module)
    type_name = layer.type if layer is not None else ""
    is_loss = f.tensor == "loss" or is_loss_type(type_name)
    op = failure_op(ctx.trace)
    evidence = [_describe_failure(f, fmt)]
    data: dict[str, Any] = {
        "dtype": s.dtype,
        "op": op,
        "nonfinite": s.nonfinite,
        "numel": s.numel,
        "nan": s.nan,
        "inf": s.posinf + s.neginf,
    }
    large: list[str] = []  # which magnitudes were large

    def near(v: float) -> bool:
        return _finite_pos(v) and not is_sentinel(v) and fmt.headroom_binades(v) < th.near_max

    def big(v: float) -> bool:
        return _finite_pos(v) and not is_sentinel(v) and fmt.headroom_binades(v) < th.large

    if near(s.amax):
        large.append("output")
    if layer is not None:
        points = ctx.pre_points(layer.forward_amax_by_step)
        at_fail = layer.forward_amax_by_step.get(f.step)
        series = points + ([(f.step, at_fail)] if _finite_pos(at_fail) else [])
        if series and not is_loss:
            label = "output" if f.tensor.startswith("output") else f"{f.module}'s output"
            text = f"{label} amax by step ({_span(series)}): {_series(series)}"
            trend = _trend(series)
            if trend:
                text += f"; {trend[0]}"
                data["growth_per_step"] = trend[1]
            evidence.append(text)
        if points:
            step, peak = max(points, key=lambda p: p[1])
            h = fmt.headroom_binades(peak)
            data["peak_before"], data["headroom_before"] = peak, h
            if near(peak):
                large.append("history")
                evidence.append(
                    f"before step {f.step} it peaked at {_n(peak)} (step {step}): "
                    f"{h:.1f} binades below {fmt.name}'s max"
                )
        wmax = max((v for _, v in ctx.pre_points(layer.param_amax_by_step)), default=None)
        if wmax is not None and big(wmax):
            large.append("weights")
            evidence.append(f"its largest |weight| reached {_n(wmax)} before step {f.step}")
    # "input[0] of attn.softmax": made by the module's own code just before that child ran
    child = f.tensor.split(" of ", 1)[1] if " of " in f.tensor else None
    pred = ctx.predecessor(child if child in ctx.order else f.module, f.step)
    in_amax = _op_input_amax(ctx)
    if pred is not None:
        p_layer, p_amax = pred
        data["input_module"], data["input_amax"] = p_layer.module, p_amax
        if math.isfinite(p_amax):
            text = (
                f"its input from {p_layer.module} ({p_layer.type}) was finite with amax "
                f"{_n(p_amax)} at step {f.step}"
            )
            before = [v for _, v in ctx.pre_points(p_layer.forward_amax_by_step)]
            if before and statistics.median(before) > 0:
                jump = p_amax / statistics.median(before)
                if jump >= 2:
                    text += f" ({jump:.2g}x its median before)"
            evidence.append(text)
            if big(p_amax) or (is_loss and _finite_pos(p_amax) and p_amax > math.sqrt(fmt.max)):
                large.append("input")  # (a loss squares its input: MSE overflows at sqrt(max))
    if in_amax is not None and big(in_amax):
        large.append("op input")
        evidence.append(f"the replay's ops before the first non-finite one reach {_n(in_amax)}")
    if op:
        src = f" at {f.source}" if f.source else ""
        evidence.append(f"the replay names aten.{op}{src} as the op that made it")
        first = next((o for o in ctx.trace.ops if o.first_nonfinite), None)
        if first is not None and first.input_inf and s.nan:
            # NaN made from infinite inputs: inf - inf, 0 x inf, a row masked throughout
            data["nan_from_inf"] = first.input_inf
            if is_softmax(op):
                data["masked_row"] = True
                evidence.append(
                    f"its inputs held {first.input_inf} infinite values and no NaN: a softmax "
                    "over a row that is -inf throughout (every position masked) is 0/0, NaN "
                    "in any precision")
            else:
                evidence.append(f"its inputs held {first.input_inf} infinite values and no "
                                "NaN: it made NaN from them (inf - inf, 0 x inf)")
    data["large"] = large

    strong = any(x in large for x in ("output", "input", "op input"))
    if op in _NAN_OPS:
        name = "overflow" if strong else "nan_op"
    elif op in _OVERFLOW_OPS:
        name = "overflow"
    else:
        name = "overflow" if large else "nan_op"
    if name == "nan_op" and is_loss:
        name = "loss_nan_op"
        losses = [
            (st.index, st.loss)
            for st in ctx.clean_steps()
            if st.loss is not None and math.isfinite(st.loss)
        ]
        if losses:
            evidence.append(
                f"loss by step ({_span(losses)}): {_series(losses)}, then "
                f"{_n(_failure_loss(ctx))} at step {f.step}"
            )
        if pred is not None:
            p_layer, p_amax = pred
            pf = p_layer.forward
            if p_amax <= 1 and pf is not None and (pf.zero or pf.underflow):
                evidence.append(
                    f"{p_layer.module}'s output looks like probabilities (amax {_n(p_amax)}) and "
                    f"held {pf.zero} exact zeros and {pf.underflow} values below "
                    f"{ctx.fmt.name}'s smallest normal over the recorded steps: log(0) = -inf"
                )
                data["probabilities"] = True
    elif name == "nan_op" and is_norm_type(type_name) and _narrow(fmt) and pred is not None:
        p_layer, p_amax = pred
        if p_amax * p_amax < fmt.smallest_normal:
            name = "norm_underflow"
            evidence.append(
                f"its input amax {_n(p_amax)} squares to {_n(p_amax * p_amax)}, below "
                f"{fmt.name}'s smallest normal {fmt.smallest_normal:.3g}: the variance underflows "
                "and rsqrt(variance + eps) is inf when eps is 0 or subnormal"
            )
    return _Class(name, fmt, evidence, data)


def _failure_loss(ctx: Context) -> float:
    f = ctx.failure
    rec = ctx.steps.get(f.step) if f is not None else None
    if rec is not None and rec.loss is not None:
        return rec.loss
    return math.nan


def _backward_class(ctx: Context) -> _Class:
    return ctx.cached("backward", lambda: _classify_backward(ctx))


def _classify_backward(ctx: Context) -> _Class:
    f = ctx.failure
    assert f is not None
    th = ctx.th
    s = f.stats
    fmt = ctx.format_of(s.dtype)
    first = next((o for o in ctx.trace.ops if o.first_nonfinite), None)
    if first is not None and first.dtype in FORMATS and first.dtype != s.dtype:
        # a float32 .grad that holds the inf a float16 matmul made: the limit is float16's
        fmt = ctx.format_of(first.dtype)
    scale = ctx.scale_at(f.step)
    layer = ctx.layer(f.module)
    op = failure_op(ctx.trace)
    evidence = [_describe_failure(f, fmt)]
    if ctx.scaler:
        evidence.append(f"observed at loss scale {scale:g}")
    rec = ctx.steps.get(f.step)
    if f.detail and rec is not None and rec.skipped:
        # the judge's unscaled replay: the skip is this op's doing, not calibration
        evidence.append(f"GradScaler skipped step {f.step}; {f.detail}")
    data: dict[str, Any] = {"dtype": s.dtype, "op": op, "scale": scale}
    large: list[str] = []

    def near(v: float) -> bool:  # observed (scaled) values: what is stored in fmt
        return _finite_pos(v) and fmt.headroom_binades(v) < th.near_max

    if near(s.amax):
        large.append("gradient")
    if layer is not None:
        observed = ctx.pre_points(layer.backward_amax_by_step)
        unscaled = ctx.pre_points(layer.backward_amax_by_step, scaled=True)
        if unscaled:
            label = "unscaled gradient" if ctx.scaler else "gradient"
            text = f"{label} amax by step ({_span(unscaled)}): {_series(unscaled)}"
            trend = _trend(unscaled)
            if trend:
                text += f"; {trend[0]}"
                data["growth_per_step"] = trend[1]
            evidence.append(text)
        if observed:
            step, peak = max(observed, key=lambda p: p[1])
            data["peak_before"] = peak
            if near(peak):
                large.append("history")
                evidence.append(
                    f"before step {f.step} its gradient reached {_n(peak)} as stored (step "
                    f"{step}): {fmt.headroom_binades(peak):.1f} binades below {fmt.name}'s max"
                )
        pg = layer.param_grad
        if f.tensor.endswith(".grad") and pg is not None and near(pg.amax):
            large.append("param_grad")
            evidence.append(f"its parameter gradients reached {_n(pg.amax)} as stored")
        if layer.forward is not None and layer.forward.zero and not large:
            evidence.append(
                f"its forward outputs held {layer.forward.zero} exact zeros over the recorded "
                "steps: derivatives such as sqrt's are infinite at 0"
            )
    if op:
        evidence.append(f"the replay names aten.{op} as the op that made it")
    data["large"] = large
    depth = _depth_growth(ctx)
    if depth is not None:
        data["depth"] = depth
        evidence.append(
            f"at step {f.step} the gradient grew layer by layer on its way back: "
            f"{_n(depth['from_amax'])} at {depth['from']} (nearest the loss) to "
            f"{_n(depth['to_amax'])} at {depth['to']}, {depth['factor']:.3g}x over "
            f"{depth['layers']} layers, about {depth['per_layer']:.3g}x a layer")
    if op in _OVERFLOW_OPS:
        name = "overflow"
    elif op in _NAN_OPS:
        name = "overflow" if "gradient" in large else "nan_op"
    else:
        name = "overflow" if large else "nan_op"
    return _Class(name, fmt, evidence, data)


#: Growth of the gradient through the model's depth, in one backward, that is an explosion.
DEPTH_GROWTH = 1000.0


def _depth_growth(ctx: Context) -> dict[str, Any] | None:
    """Exploding gradients through depth: in the failing step's backward, the gradient reaching
    each weighted module grew steadily from the last one (nearest the loss) to the culprit, by
    three orders of magnitude or more (a deep stack without residual paths or with a gain
    above 1 per layer)."""
    f = ctx.failure
    assert f is not None
    idx = ctx.order.get(f.module)
    if idx is None:
        return None
    layers = ctx.trace.layers
    kind = layers[idx].type
    chain = []
    # modules of the culprit's type (a norm between them rescales the gradient: comparing
    # like with like keeps the series monotone)
    for layer in layers[idx + 1:]:  # the culprit's own gradient is the non-finite one
        v = layer.backward_amax_by_step.get(f.step)
        if layer.type == kind and _finite_pos(v):
            chain.append((layer.module, v))
    pts = chain
    if len(pts) < 8:
        return None
    pts.reverse()  # backward order: from the loss towards the culprit
    rises = sum(b[1] > a[1] for a, b in itertools.pairwise(pts))
    factor = pts[-1][1] / pts[0][1]
    if factor < DEPTH_GROWTH or rises * 3 < 2 * (len(pts) - 1):
        return None
    return {"factor": factor, "layers": len(pts), "per_layer": factor ** (1 / (len(pts) - 1)),
            "from": pts[0][0], "from_amax": pts[0][1], "to": pts[-1][0], "to_amax": pts[-1][1]}


def _optimizer_class(ctx: Context) -> _Class:
    return ctx.cached("optimizer", lambda: _classify_optimizer(ctx))


def _classify_optimizer(ctx: Context) -> _Class:
    """lr (weights or updates grew over steps, or one update beyond the format's max) or eps
    (an optimizer eps that is 0 in the parameters' format, or a replayed step that divides by
    a denominator holding zeros)."""
    f = ctx.failure
    assert f is not None
    th = ctx.th
    s = f.stats
    fmt = ctx.format_of(s.dtype)
    layer = ctx.layer(f.module)
    evidence = [_describe_failure(f, fmt) + " right after the optimizer step"]
    data: dict[str, Any] = {"dtype": s.dtype}
    grew = False
    if layer is not None:
        points = [
            (st, v)
            for st, v in sorted(layer.param_amax_by_step.items())
            if st <= f.step and _finite_pos(v)
        ]
        g = _growth(points[-th.window :])
        if g is not None:
            data["growth_per_step"] = g.per_step
            grew = _is_weight_growth(g, th)
            evidence.append(
                f"{f.module}'s largest |weight| by step ({_span(points[-th.window :])}): "
                f"{_series(points)}; about {g.per_step:.3g}x a step"
            )
        elif points:
            evidence.append(
                f"{f.module}'s largest |weight| before the step: {_n(points[-1][1])} (no growth "
                "recorded: the weights were small and steady)"
            )
    norms = ctx.grad_norms()
    if norms:
        evidence.append(f"gradient norm by step ({_span(norms[-6:])}): {_series(norms)}")
    has_inf = bool(s.posinf or s.neginf)
    pg = layer.param_grad if layer is not None else None
    tiny = pg is not None and pg.underflow_fraction >= th.underflow
    opt = _optimizer_of(ctx, s.dtype)
    eps_zero = opt is not None and opt.eps is not None and opt.eps > 0 and \
        eps_in_format(opt.eps, fmt) == "zero"
    op = next((o for o in ctx.trace.ops if o.phase == "optimizer" and o.first_nonfinite), None)
    op_name = _op_base(op.op) if op is not None else None
    divides = op_name in ("div", "addcdiv", "reciprocal", "rsqrt", "sqrt")
    big_update = False
    if opt is not None and opt.lr and pg is not None and _finite_pos(pg.amax):
        big_update = opt.lr * pg.amax > fmt.max
    if opt is not None:
        data.update(optimizer=opt.type, lr=opt.lr)
        if opt.eps is not None:
            data["eps"] = opt.eps
    if op is not None:
        data["op"] = op_name
        where = f" at {op.source}" if op.source else ""
        evidence.append(f"replaying optimizer.step() on copies names aten.{op_name}{where} as "
                        "the first op that made a non-finite value")
    if grew or big_update:
        name = "lr"
        if big_update and opt is not None and pg is not None:
            evidence.append(f"lr {opt.lr:g} x largest gradient {_n(pg.amax)} is beyond "
                            f"{fmt.name}'s max: one update that large cannot be stored")
    elif eps_zero or (divides and _narrow(fmt)) or (
            opt is None and _narrow(fmt) and (not has_inf or tiny)):
        name = "eps"
        eps = opt.eps if opt is not None and opt.eps is not None else _ADAM_EPS
        who = f"{opt.type}'s eps={eps:g}" if opt is not None and opt.eps is not None else \
            f"an optimizer eps such as Adam's default eps={eps:g}"
        evidence.append(
            f"{who} is {eps_in_format(eps, fmt)} in {fmt.name}, the parameters' format "
            f"(smallest subnormal {fmt.smallest_subnormal:.3g}; torch.tensor({eps:g}, "
            f"dtype=torch.{fmt.name}) == 0): where v, the running mean of grad**2, underflows "
            "to 0, m / (sqrt(v) + eps) divides by zero"
        )
        if pg is not None and pg.finite_nonzero:
            evidence.append(
                f"{_pct(pg.underflow_fraction)} of {f.module}'s parameter gradients were below "
                f"{fmt.name}'s smallest normal ({fmt.smallest_normal:.3g})"
            )
        v = vanished_eps(ctx.trace.ops, "optimizer")
        if v is not None and v.add.zeros:
            evidence.append(
                f"in the replay, adding eps={v.eps:g} ({v.add.source or 'the optimizer'}) left "
                f"{v.add.zeros} of {v.add.numel} denominator values exactly 0")
    else:
        name = "lr"
    return _Class(name, fmt, evidence, data)


def _op_base(op: str) -> str:
    """``aten.addcdiv_.default`` -> ``addcdiv`` (in-place or not, the same arithmetic)."""
    parts = [p for p in op.replace("::", ".").split(".") if p not in _OP_NOISE]
    return parts[0].rstrip("_") if parts else op


def _optimizer_of(ctx: Context, dtype: str) -> Any:
    """The optimizer that steps parameters of ``dtype`` (the first one when several do)."""
    opts = ctx.trace.optimizers
    return next((o for o in opts if dtype in o.param_dtypes), opts[0] if opts else None)


#: torch.optim.Adam's default eps.
_ADAM_EPS = 1e-8


def _is_weight_growth(g: Growth, th: Thresholds) -> bool:
    if g.last < th.weight_floor:
        return False
    if g.steps >= 2:
        return g.per_step >= th.weight_growth
    return g.steps == 1 and g.per_step >= th.weight_jump
