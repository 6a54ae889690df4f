"""Error rules: the first failure explained by its phase's class, GradScaler misuse and the
loss-scale collapse."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from nanhunt.analyse.diagnose._base import (
    _NAN_OPS,
    _OVERFLOW_OPS,
    Context,
    _counts,
    _finding,
    _finite_pos,
    _n,
    _series,
    _span,
    eps_in_format,
    rule,
)
from nanhunt.analyse.diagnose.classify import (
    _ADAM_EPS,
    _backward_class,
    _forward_class,
    _of,
    _optimizer_class,
    _where,
    failure_op,
)
from nanhunt.analyse.diagnose.shared import grad_site, short_source
from nanhunt.errors import NanhuntError
from nanhunt.formats import get_format
from nanhunt.trace import Finding, StepRecord, Trace

# ----------------------------------------------------------------------------- error rules


@rule(id="bad-input", kind="bad_input", needs=("first_failure",))
def bad_input(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """The batch itself carried NaN/Inf: the first non-finite value is an input no module made."""
    f = ctx.failure
    if f is None or f.phase != "data":
        return
    s = f.stats
    owner = f" of {f.module}" if f.module else ""
    evidence = [f"step {f.step}: {f.tensor}{owner} held {_counts(s)} of {_of(s.numel)}"]
    if s.amax > 0:
        evidence.append(
            f"its finite values reach {_n(s.amax)} "
            f"({ctx.fmt.headroom_binades(s.amax):.1f} binades below {ctx.fmt.name}'s max)"
        )
    for path, idx in f.bad_samples.items():
        shown = ", ".join(str(i) for i in idx[:10]) + (" ..." if len(idx) > 10 else "")
        evidence.append(
            f"{path}: {len(idx)} sample{'s' if len(idx) != 1 else ''} with non-finite values, "
            f"batch positions {shown}"
        )
    yield _finding(
        "error",
        f"the batch at step {f.step} carried non-finite values into "
        f"{f.module + ' (' + f.tensor + ')' if f.module else 'the ' + f.tensor}; "
        "no computation made them",
        evidence,
        phase="data",
        step=f.step,
        module=f.module,
        tensor=f.tensor,
        data={
            "nan": s.nan,
            "posinf": s.posinf,
            "neginf": s.neginf,
            "numel": s.numel,
            "amax": s.amax,
            "samples": {k: list(v) for k, v in f.bad_samples.items()},
        },
    )


def _forward_error(ctx: Context, wanted: str, message: str) -> Iterator[Finding]:
    f = ctx.failure
    if f is None or f.phase != "forward":
        return
    c = _forward_class(ctx)
    if c.name != wanted:
        return
    yield _finding(
        "error",
        message.format(f=f, fmt=c.fmt, who=f.module or "the loss"),
        list(c.evidence),
        phase=f.phase,
        step=f.step,
        module=f.module or None,
        tensor=f.tensor,
        data=dict(c.data),
    )


@rule(id="forward-overflow", kind="overflow", needs=("first_failure",))
def forward_overflow(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """A finite forward computation exceeded its format's max (large inputs, outputs or weights)."""
    scaler = " GradScaler cannot help: it only scales gradients." if ctx.scaler else ""
    yield from _forward_error(
        ctx,
        "overflow",
        "{who}'s {f.tensor} exceeds {fmt.name}'s max ({fmt.max:g}) in the forward pass at step "
        "{f.step}." + scaler,
    )


@rule(id="forward-nan-op", kind="nan_op", needs=("first_failure",))
def forward_nan_op(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """A forward op made NaN/Inf from small finite inputs: log(0), sqrt(x<0), 0/0, not overflow."""
    yield from _forward_error(
        ctx,
        "nan_op",
        "{who} made non-finite values from finite inputs of modest size at step {f.step}: an "
        "invalid operation (log(0), sqrt of a negative, 0/0), not an overflow",
    )


@rule(id="loss-nan-op", kind="nan_op", needs=("first_failure",))
def loss_nan_op(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """The loss became non-finite from finite, small inputs (log of a probability that is 0)."""
    yield from _forward_error(
        ctx,
        "loss_nan_op",
        "the loss ({who}) became non-finite at step {f.step} from finite inputs of modest size: "
        "an invalid operation in the loss, such as log of a probability that is 0",
    )


@rule(id="norm-underflow", kind="underflow", needs=("first_failure", "layers"))
def norm_underflow(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """A normalisation made NaN/Inf because its inputs' variance underflowed the format."""
    yield from _forward_error(
        ctx,
        "norm_underflow",
        "{who} made non-finite values at step {f.step}: its inputs are so small that their "
        "variance underflows {fmt.name}, and the normalisation divides by (nearly) zero",
    )


def _backward_error(ctx: Context, wanted: str, message: str) -> Iterator[Finding]:
    f = ctx.failure
    if f is None or f.phase not in ("backward", "loss_scaling"):
        return
    c = _backward_class(ctx)
    if c.name != wanted:
        return
    evidence = list(c.evidence)
    data = dict(c.data)
    if f.phase == "loss_scaling":
        data.update(collapse=True, overflow=False)
        if wanted != "nan_op" or _collapse_cause(ctx) != "nan_op":
            return  # an overflowing gradient behind a collapse: scale-collapse explains it
        # the collapse is the evidence: the op made NaN/inf at every scale GradScaler tried
        evidence += _collapse_evidence(ctx)
        message += "; GradScaler skipped every step and the loss scale collapsed as a result"
    yield _finding(
        "error",
        message.format(f=f, fmt=c.fmt),
        evidence,
        phase="backward",
        step=f.step,
        module=f.module or None,
        tensor=f.tensor,
        data=data,
    )


@rule(id="backward-overflow", kind="overflow", needs=("first_failure",))
def backward_overflow(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """A gradient exceeded its format's max in backward, after approaching it in earlier steps
    (when it grew layer by layer through the model's depth to get there, that is an explosion:
    the finding is exploding-gradient's)."""
    f = ctx.failure
    c = _backward_class(ctx) if f is not None and f.phase == "backward" else None
    if c is not None and c.name == "overflow" and "depth" in c.data:
        depth = c.data["depth"]
        yield _finding(
            "error",
            f"exploding gradients through depth: at step {f.step} the gradient grew about "
            f"{depth['per_layer']:.3g}x a layer over {depth['layers']} layers on its way back "
            f"from the loss ({depth['factor']:.3g}x in all) and overflowed {c.fmt.name} in "
            f"{f.module}'s backward",
            list(c.evidence),
            kind="exploding_gradient",
            rule="exploding-gradient",
            phase="backward",
            step=f.step,
            module=f.module or None,
            tensor=f.tensor,
            data={**c.data, "depth_growth": depth["factor"], "from_step": f.step},
        )
        return
    rec = ctx.steps.get(f.step) if f is not None else None
    if c is not None and c.name == "overflow" and f.detail and rec is not None and rec.skipped \
            and any(not st.skipped for st in ctx.trace.steps if st.index < f.step):
        # the judge's unscaled replay overflowed too, after applied updates: they grew the
        # gradients past the format
        yield _grown_past_the_format(ctx, c.evidence, f"GradScaler skipped step {f.step}",
                                     {"skipped": 1})
        return
    yield from _backward_error(
        ctx,
        "overflow",
        "the gradient {f.tensor} of {f.module} exceeds {fmt.name}'s max ({fmt.max:g}) in the "
        "backward pass at step {f.step}",
    )


@rule(id="backward-nan-op", kind="nan_op", needs=("first_failure",))
def backward_nan_op(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """A backward op made NaN/Inf from small gradients: a derivative infinite at its input."""
    yield from _backward_error(
        ctx,
        "nan_op",
        "the gradient {f.tensor} of {f.module} became non-finite at step {f.step} while "
        "gradients were small: an op whose derivative is infinite at its input (sqrt at 0, "
        "a fractional power of 0, the norm of a zero vector)",
    )


@rule(id="optimizer-update", kind="lr_too_high", needs=("first_failure",))
def optimizer_update(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """The optimizer step itself drove weights to Inf/NaN: the update is too large."""
    f = ctx.failure
    if f is None or f.phase != "optimizer" or _optimizer_class(ctx).name != "lr":
        return
    c = _optimizer_class(ctx)
    yield _finding(
        "error",
        f"the optimizer step at step {f.step} made {f.tensor} non-finite: the update is larger "
        f"than {c.fmt.name} can hold, so the learning rate is too high for these gradients",
        list(c.evidence),
        phase="optimizer",
        step=f.step,
        module=f.module or None,
        tensor=f.tensor,
        data=dict(c.data),
    )


@rule(id="optimizer-eps", kind="underflow", needs=("first_failure",))
def optimizer_eps(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """Low-precision weights turned NaN in an update without growing: an eps that is 0 there."""
    f = ctx.failure
    if f is None or f.phase != "optimizer" or _optimizer_class(ctx).name != "eps":
        return
    c = _optimizer_class(ctx)
    eps = c.data.get("eps", _ADAM_EPS)
    who = c.data.get("optimizer") or "the optimizer"
    yield _finding(
        "error",
        f"the optimizer step at step {f.step} made {f.tensor} non-finite without its weights "
        f"growing: {who}'s eps={eps:g} is {eps_in_format(eps, c.fmt)} in {c.fmt.name}, the "
        "parameters' format, so its update divides by zero; use eps=1e-4 or keep float32 "
        "master weights (autocast)",
        list(c.evidence),
        phase="optimizer",
        step=f.step,
        module=f.module or None,
        tensor=f.tensor,
        data=dict(c.data),
    )


_MISUSE = {
    "optimizer_outside_scaler_step": (
        "optimizer.step() runs outside scaler.step(optimizer), so the steps GradScaler skips "
        "(inf/NaN gradients) are applied anyway",
        "call scaler.step(optimizer) instead of optimizer.step(): it skips those steps",
    ),
    "optimizer_stepped_twice": (
        "optimizer.step() runs again after scaler.step(optimizer): every update is applied "
        "twice, and the steps GradScaler skips (inf/NaN gradients) are applied anyway",
        "remove the optimizer.step() call: scaler.step(optimizer) already steps the optimizer",
    ),
    "optimizer_on_scaled_grads": (
        "optimizer.step() ran on gradients still multiplied by the loss scale, so every "
        "update was that many times too large",
        "call scaler.step(optimizer) instead of optimizer.step(): it unscales the gradients "
        "and skips steps whose gradients overflowed",
    ),
    "clip_on_scaled_grads": (
        "clip_grad_norm_ ran on gradients still multiplied by the loss scale, so max_norm was "
        "in effect divided by the scale and every step was clipped to a tiny update",
        "call scaler.unscale_(optimizer) before torch.nn.utils.clip_grad_norm_",
    ),
    "zero_grad_after_unscale": (
        "optimizer.zero_grad() runs between scaler.unscale_(optimizer) and "
        "scaler.step(optimizer), so the step finds no gradient and applies no update",
        "call optimizer.zero_grad() at the start of the iteration (or after scaler.update()), "
        "never between unscale_ and step",
    ),
    "unscaled_loss": (
        "scaler.step()/update() ran after a backward of a loss that scaler.scale() never "
        "multiplied, so the gradients were divided by a scale they never had",
        "call scaler.scale(loss).backward(), not loss.backward()",
    ),
}


@rule(id="scaler-misuse", kind="loss_scale", needs=("steps",))
def scaler_misuse(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """GradScaler used the wrong way round: its effect on every update is a factor of the
    scale, or the updates it refuses are applied, which explains whatever failure follows."""
    calls = {c.code: c for c in trace.loop_calls}
    for code, (what, fix) in _MISUSE.items():
        steps = [s for s in trace.steps if code in s.misuse]
        if not steps:
            continue
        scales = sorted({s.scale for s in steps if s.scale})
        if len(scales) == 1:
            what = what.replace("the loss scale", f"the loss scale ({scales[0]:g})", 1)
        call = calls.get(code)
        at = ""
        evidence = [f"seen at {len(steps)} step(s): {_span([(s.index, 0.0) for s in steps])}"]
        if call is not None and call.source:
            at = f" ({call.source_line or 'the call'} at {short_source(call.source)})"
            evidence.insert(0, f"the call: {call.source}: {call.source_line or ''}".rstrip(": "))
        if scales:
            evidence.append(f"loss scale in effect: {', '.join(f'{x:g}' for x in scales[:4])}")
        f = ctx.failure
        applied = code in ("optimizer_outside_scaler_step", "optimizer_stepped_twice")
        if applied and call is not None and call.found_inf:
            evidence.append(
                f"step {call.step}: GradScaler found inf/NaN in the gradients (it would have "
                "skipped this step) and optimizer.step() applied them")
            if f is not None and f.phase == "optimizer":
                evidence.append(
                    f"{f.tensor} was non-finite right after that update, while the weights had "
                    "not grown before: not a learning rate problem")
        elif f is not None:
            evidence.append(f"the first non-finite value followed at {f.where()}")
        yield _finding(
            "error",
            f"{what}{at}: {fix}",
            evidence,
            phase="loss_scaling",
            step=steps[0].index,
            data={"misuse": code, "steps": [s.index for s in steps[:50]],
                  "source": call.source if call is not None else None,
                  "source_line": call.source_line if call is not None else None},
        )


def _collapse_streak(ctx: Context) -> list[StepRecord]:
    f = ctx.failure
    assert f is not None
    streak = []
    for s in sorted(ctx.trace.steps, key=lambda s: s.index):
        if s.index < f.step:
            continue
        if not s.skipped:
            break
        streak.append(s)
    return streak


def _collapse_evidence(ctx: Context) -> list[str]:
    f = ctx.failure
    assert f is not None
    streak = _collapse_streak(ctx)
    first = ctx.scale_at(f.step) if ctx.steps.get(f.step) else None
    events = [e for e in ctx.trace.scaler_events if e.event == "backoff" and e.step >= f.step]
    last = events[-1].scale_after if events else (streak[-1].scale if streak else None)
    out = []
    if first is not None and last is not None:
        out.append(
            f"GradScaler skipped {len(streak)} steps in a row from step {f.step} and lowered "
            f"the scale from {first:g} to {last:g}: the gradient was non-finite at every scale"
        )
    return out


def _collapse_cause(ctx: Context) -> str:
    """Why the scale collapsed: ``nan_op`` (a backward op makes NaN/inf whatever the scale) or
    ``overflow`` (unscaled gradients too large for the format: exploding gradients)."""
    f = ctx.failure
    assert f is not None
    s = f.stats
    op = failure_op(ctx.trace)
    layer = ctx.layer(f.module)
    peak = ctx.backward_peak(layer) if layer is not None else None
    if peak is not None and ctx.fmt.headroom_binades(peak[1]) < ctx.th.near_max:
        return "overflow"
    if op in _OVERFLOW_OPS:  # a matmul's NaN is inf * 0 or inf - inf: an overflow first
        return "overflow"
    if op in _NAN_OPS or (s.nan and not (s.posinf or s.neginf)):
        return "nan_op"
    # no op named: a collapse that begins after applied steps, with inf in the gradient, grew
    # into it (the updates before it made the gradients larger); from step 0 on it is an op
    applied = [st for st in ctx.trace.steps if st.index < f.step and not st.skipped]
    return "overflow" if applied and (s.posinf or s.neginf) else "nan_op"


def _grown_past_the_format(ctx: Context, evidence: list[str], what: str,
                           data: dict[str, Any]) -> Finding:
    """Gradients that overflow the format at every loss scale after updates were applied:
    exploding gradients, named by the module whose own gradients grew most (``what`` says what
    GradScaler did about it)."""
    f = ctx.failure
    assert f is not None
    site = grad_site(ctx) or (f.module, [])
    applied = [st for st in ctx.clean_steps() if _finite_pos(st.grad_norm)]
    evidence = list(evidence)
    if applied:
        evidence.append(
            "gradient norm of the applied steps before it "
            f"({_span([(st.index, 0.0) for st in applied[-6:]])}): "
            f"{_series([(st.index, st.grad_norm) for st in applied])}"
        )
    if site[1]:
        evidence.append(f"{site[0]}'s largest unscaled parameter gradient by step "
                        f"({_span(site[1])}): {_series(site[1])}")
    return _finding(
        "error",
        f"exploding gradients in {site[0] or 'the model'}: after the applied updates the "
        f"gradients overflow {ctx.fmt.name} at every loss scale, so {what} (the skips are the "
        "symptom; clip the gradient norm)",
        evidence,
        kind="exploding_gradient",
        phase="backward",
        step=f.step,
        module=site[0] or None,
        tensor=f.tensor,
        rule="exploding-gradient",
        data={**data, "overflow": True, "spike": True,
              "from_step": applied[0].index if applied else f.step},
    )


@rule(id="scale-collapse", kind="loss_scale", needs=("first_failure", "steps"))
def scale_collapse(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """GradScaler skipped step after step until the scale collapsed because unscaled gradients
    exceed the format (a backward op that makes NaN at every scale is backward-nan-op's)."""
    f = ctx.failure
    if f is None or f.phase != "loss_scaling":
        return
    if _collapse_cause(ctx) == "nan_op" and _backward_class(ctx).name == "nan_op":
        return  # backward-nan-op names the op; the collapse is its evidence
    streak = _collapse_streak(ctx)
    first = ctx.scale_at(f.step) if ctx.steps.get(f.step) else None
    events = [e for e in trace.scaler_events if e.event == "backoff" and e.step >= f.step]
    last = events[-1].scale_after if events else (streak[-1].scale if streak else None)
    n = len(streak)
    s = f.stats
    evidence = []
    if first is not None and last is not None:
        evidence.append(
            f"GradScaler skipped {n} steps in a row from step {f.step} and lowered "
            f"the scale from {first:g} to {last:g}"
        )
    evidence.append(f"step {f.step}: {_where(f)} ({s.dtype}) held {_counts(s)} of {_of(s.numel)}")
    if streak and streak[-1].scale is not None:
        evidence.append(
            f"at step {streak[-1].index}, at scale {streak[-1].scale:g}, the "
            "gradients were still non-finite: the value does not depend on the scale"
        )
    layer = ctx.layer(f.module)
    cause = "an invalid op in backward (0 * inf, the derivative of sqrt at 0)"
    overflow = False
    if layer is not None:
        peak = ctx.backward_peak(layer)
        if peak is not None:
            h = ctx.fmt.headroom_binades(peak[1])
            evidence.append(
                f"{f.module}'s unscaled gradient peaked at {_n(peak[1])} before "
                f"(step {peak[0]}): {h:.1f} binades below {ctx.fmt.name}'s max"
            )
            if h < ctx.th.near_max:
                cause, overflow = "unscaled gradients that exceed the max", True
    if s.nan and not (s.posinf or s.neginf):
        cause, overflow = "NaN made in backward (0 * inf, the derivative of sqrt at 0)", False
    if not overflow and _collapse_cause(ctx) == "overflow":
        yield _grown_past_the_format(
            ctx, evidence, f"GradScaler skipped {n} steps in a row and the scale collapsed",
            {"skipped": n, "scale_from": first, "scale_to": last, "collapse": True})
        return
    yield _finding(
        "error",
        f"the loss scale collapsed: GradScaler skipped {n} steps in a row while the gradient of "
        f"{f.module or 'the loss'} stayed non-finite; the cause is {cause}, not the scale",
        evidence,
        phase="loss_scaling",
        step=f.step,
        module=f.module or None,
        tensor=f.tensor,
        data={"skipped": n, "scale_from": first, "scale_to": last, "overflow": overflow},
    )


# ----------------------------------------------------------------------------- communication


@rule(id="reduction-overflow", kind="overflow", needs=("first_failure",))
def reduction_overflow(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """The gradient reduction across ranks made a gradient non-finite: a DDP communication hook
    or an FSDP2 reduce dtype narrower than the gradients' values."""
    f = ctx.failure
    if f is None or f.phase != "communication" or not f.reduce_dtype:
        return
    try:
        fmt = get_format(f.reduce_dtype)
    except NanhuntError:
        return
    local = f.local_grad
    how = f.reduction or "the reduction"
    evidence = [f"{f.tensor} after {how} at step {f.step}: {_counts(f.stats)}"]
    data: dict[str, Any] = {"reduce_dtype": fmt.name, "reduction": how,
                            "hooks": list(trace.run.comm_hooks)}
    if local is not None:
        if local.nonfinite or local.amax <= fmt.max:
            return  # finite and in range here: another rank's values, not this reduction's
        evidence.append(
            f"this rank's own {f.tensor} before the reduction was finite, amax {_n(local.amax)}"
            f", above {fmt.name}'s max {fmt.max:g} ({local.overflow} of {local.numel} values "
            f"above the run's target {ctx.fmt.name}'s max)" if ctx.fmt.name != fmt.name else
            f"this rank's own {f.tensor} before the reduction was finite, amax {_n(local.amax)}"
            f", above {fmt.name}'s max {fmt.max:g} ({local.overflow} of {local.numel} values)")
        data["local_amax"] = local.amax
        message = (f"the gradient reduction overflowed {fmt.name} at step {f.step}: {how} "
                   f"reduces {f.tensor} in {fmt.name}, and this rank's finite gradient "
                   f"(amax {_n(local.amax)}) exceeds {fmt.max:g}")
    else:
        if fmt.name not in ("float16", "bfloat16"):
            return  # a float32 reduction of values it was not shown: no cause to name
        evidence.append("this rank's gradients before the reduce-scatter are not observed per "
                        "parameter (FSDP2 reduces the unsharded gradient)")
        message = (f"{f.tensor} came out of {how} non-finite at step {f.step}, reduced in "
                   f"{fmt.name} (the MixedPrecisionPolicy's reduce dtype)")
    if trace.run.world_size > 1:
        evidence.append(f"{trace.run.world_size} ranks: the reduction sums every rank's "
                        "gradient (DDP's compression hooks divide by the world size after the "
                        "cast)")
    yield _finding("error", message, evidence, phase="communication", step=f.step,
                   module=f.module or None, tensor=f.tensor, data=data)


@rule(id="recompute-diverged", kind="nan_op", needs=("first_failure",))
def recompute_diverged(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """Activation checkpointing recomputed a module's forward in backward and got non-finite
    values where the forward itself was finite: the module's forward is not repeatable."""
    f = ctx.failure
    if f is None or f.phase != "backward" or not f.tensor.endswith(" (recomputed)"):
        return
    s = f.stats
    kind = "nan_op" if s.nan else "overflow"
    yield _finding(
        "error",
        f"the forward of {f.module} that activation checkpointing recomputed in backward at "
        f"step {f.step} went non-finite ({_counts(s)}), though the forward it repeats was "
        "finite: the gradients of everything before it are computed from values the forward "
        "never had",
        [f"{f.module}'s output in the forward at step {f.step}: finite (judged there)",
         f"its recomputation in backward: {_counts(s)}",
         "what differs between the two runs of the forward: state the module reads that "
         "changed after the forward (an attribute, a buffer edited in place), a random op "
         "outside checkpoint's RNG handling, or a non-deterministic kernel"],
        kind=kind, phase="backward", step=f.step, module=f.module or None, tensor=f.tensor,
        data={"recomputed": True})
