"""Advice: recommendations with computed values and snippets, from a diagnosed trace. Torch-free.

:func:`advise` reads ``trace.diagnosis`` and ``trace.warnings`` (running
:func:`~nanhunt.analyse.diagnose.diagnose` first when neither is set) and fills
``trace.recommendations``: the diagnosis's recommendations first, most relevant first, then the
warnings'. Values are computed from the trace (the gradient exponent histogram, the gradient-norm
history, weight growth); snippets are Python the user pastes, naming modules by their qualified
names and assuming the user's variables are called ``model``, ``optimizer``, ``scaler`` and
``loss``. ``verified`` stays False: the replay checks advice later.

>>> from nanhunt.formats import get_format
>>> choice = choose_init_scale({-20: 100}, get_format("float16"), 2.0**16)
>>> choice.k, choice.chosen.normal
(33, 1.0)
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from nanhunt.analyse.curve_advice import CURVE_ADVICE
from nanhunt.analyse.diagnose import (
    Context,
    ScaleFractions,
    diagnose,
    eps_in_format,
    failure_op,
    is_loss_type,
    is_norm_type,
    is_sentinel,
    module_pattern,
    scale_fractions,
)
from nanhunt.analyse.remedies import attach_fixes
from nanhunt.formats import NumberFormat, get_format
from nanhunt.trace import Finding, LayerStats, Recommendation, Trace

__all__ = [
    "ScaleChoice",
    "advise",
    "choose_init_scale",
    "clip_value",
    "eps_in_format",
    "lr_factor",
    "nice_ceil",
    "suggest_eps",
]

#: Formats autocast computes in, where GradScaler's loss scale is the tool.
_AUTOCAST_FORMATS = ("float16", "bfloat16")

#: GradScaler's defaults (DESIGN.md §3).
DEFAULT_INIT_SCALE = 2.0**16
DEFAULT_GROWTH_INTERVAL = 2000

#: Normal-mass gain (fraction of all values) worth giving up the second binade of headroom.
_HEADROOM_GAIN = 0.01

#: T5's margin below the format's max for clamping activations (finfo.max - 1000).
_T5_CLAMP_MARGIN = 1000.0

#: Percentile of healthy gradient norms that clip_grad_norm's max_norm starts from.
_CLIP_PERCENTILE = 90.0

#: Relative weight change per step that lower_lr aims for.
_TARGET_UPDATE = 0.1

#: Where normalisation modules keep their eps (torch, Hugging Face T5/Llama norms, Keras ports).
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")

_ADAM = "Adam's default eps"

#: Typical defaults, to show what becomes of them in the target format.
_EPS_DEFAULTS = {
    _ADAM: 1e-8,
    "LayerNorm's default eps": 1e-5,
    "a common RMSNorm eps": 1e-6,
}


# ----------------------------------------------------------------------------- pure arithmetic


@dataclass(frozen=True)
class ScaleChoice:
    """A loss scale ``2**k`` chosen from a gradient exponent histogram."""

    k: int
    current: ScaleFractions  # at the scale in use (or GradScaler's default)
    chosen: ScaleFractions  # at 2**k
    headroom: int | None  # binades from the largest scaled gradient's binade to the max binade

    @property
    def scale(self) -> float:
        return 2.0**self.k


def choose_init_scale(
    hist: dict[int, int], fmt: NumberFormat, current_scale: float | None = None
) -> ScaleChoice:
    """The loss scale ``2**k`` for unscaled gradients with exponent histogram ``hist``.

    A scale ``2**k`` moves binade ``e`` to ``e + k``. The choice overflows nothing, keeps two
    binades of headroom below ``fmt``'s max binade (one, when that keeps at least 1% more of the
    mass normal) and, within that, keeps the most mass normal: the largest such ``k``.
    Fractions are reported at ``current_scale`` (GradScaler's default 2**16 when None) and at
    the choice.

    >>> from nanhunt.formats import get_format
    >>> c = choose_init_scale({0: 1, -10: 1}, get_format("float16"))
    >>> c.k, c.current.overflow, c.chosen.overflow
    (13, 0.5, 0.0)
    """
    current = current_scale if current_scale and current_scale > 0 else DEFAULT_INIT_SCALE
    k_now = round(math.log2(current))
    occupied = [e for e, c in hist.items() if c > 0]
    if not occupied:
        now = scale_fractions(hist, fmt, k_now)
        return ScaleChoice(k_now, now, now, None)
    top = max(occupied)
    k2 = fmt.max_binade - 2 - top
    k1 = k2 + 1
    two, one = scale_fractions(hist, fmt, k2), scale_fractions(hist, fmt, k1)
    k, chosen = (k1, one) if one.normal - two.normal >= _HEADROOM_GAIN else (k2, two)
    return ScaleChoice(k, scale_fractions(hist, fmt, k_now), chosen, fmt.max_binade - (top + k))


def nice_ceil(x: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten that is >= ``x``.

    >>> nice_ceil(6.88), nice_ceil(0.3), nice_ceil(2.0)
    (10.0, 0.5, 2.0)
    """
    if not x > 0:
        return 1.0
    exp = math.floor(math.log10(x))
    for m in (1, 2, 5, 10):
        v = m * 10.0**exp
        if v >= x * (1 - 1e-12):
            return float(f"{v:.12g}")
    return 10.0 ** (exp + 1)


def clip_value(norms: list[float], percentile: float = 90.0) -> float | None:
    """``max_norm`` for gradient clipping: the nearest-rank percentile of healthy gradient
    norms, rounded up with :func:`nice_ceil`. None without norms."""
    vals = sorted(v for v in norms if v > 0 and math.isfinite(v))
    if not vals:
        return None
    rank = max(1, math.ceil(percentile / 100 * len(vals)))
    return nice_ceil(vals[rank - 1])


def lr_factor(growth_per_step: float) -> float:
    """What to multiply the learning rate by when weights grow ``growth_per_step`` x a step.

    The weights change by ``growth - 1`` of their size a step; updates scale with the learning
    rate, so the factor that brings that change to 10% is ``0.1 / (growth - 1)``, rounded down
    to a power of ten, between 0.01 and 0.1.

    >>> lr_factor(35.0), lr_factor(1.6)
    (0.01, 0.1)
    """
    if not growth_per_step > 1:
        return 0.1
    f = _TARGET_UPDATE / (growth_per_step - 1)
    # a diverging run grows by feedback, far faster than its learning rate alone would say:
    # more than 100x lower is rarely needed, and a second look after the change is cheap
    return max(0.01, min(0.1, 10.0 ** math.floor(math.log10(f))))


def suggest_eps(fmt: NumberFormat) -> float:
    """The smallest power of ten that is a normal number in ``fmt`` (1e-4 for float16).

    >>> from nanhunt.formats import get_format
    >>> suggest_eps(get_format("float16"))
    0.0001
    """
    return float(f"1e{math.ceil(math.log10(fmt.smallest_normal))}")


# ----------------------------------------------------------------------------- snippet helpers


def _n(x: float) -> str:
    return f"{x:.3g}"


def _span(points: list[tuple[int, float]]) -> str:
    a, b = points[0][0], points[-1][0]
    return f"step {a}" if a == b else f"steps {a}-{b}"


def _pct(frac: float) -> str:
    """``0%``, ``<0.01%``, ``0.83%``, ``2.8%``, ``31%``, ``100%``."""
    if frac <= 0:
        return "0%"
    if frac < 0.0001:
        return "<0.01%"
    return f"{100 * frac:.0f}%" if frac >= 0.1 else f"{100 * frac:.2g}%"


def _q(name: str) -> str:
    """A double-quoted Python string literal (module names come from user code)."""
    return json.dumps(name)


def _device_type(trace: Trace) -> str:
    m = re.match(r"[a-z]+", trace.run.device or "")
    return m.group(0) if m and m.group(0) in ("cpu", "cuda", "xpu", "mps", "hpu") else "cuda"


def _module_ref(ctx: Context, name: str) -> str:
    """How a snippet reaches a module: a loss outside the model by its variable name."""
    layer = ctx.layer(name)
    if layer is not None and "." not in name and is_loss_type(layer.type):
        return name
    return f"model.get_submodule({_q(name)})"


def _fractions(fr: ScaleFractions) -> str:
    return (
        f"{_pct(fr.overflow)} overflow, {_pct(fr.subnormal)} subnormal, "
        f"{_pct(fr.flushed)} flush to zero, {_pct(fr.normal)} normal"
    )


def _narrow_dtype(layer: LayerStats | None, fmt: NumberFormat) -> bool:
    return layer is not None and fmt.name in layer.dtypes


def _torch_dtype(fmt: NumberFormat) -> str:
    return f"torch.{fmt.name}"



# ----------------------------------------------------------------------------- builders
# Each takes the trace, the diagnosis context and the finding it answers, and returns one
# recommendation or None when the evidence does not support it.

Builder = Callable[[Trace, Context, Finding], "Recommendation | None"]


def _init_scale(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    hist, source = ctx.gradient_histogram()
    fmt = ctx.fmt
    if fmt.name not in _AUTOCAST_FORMATS:
        return None  # float8 training scales per tensor (Transformer Engine), not with GradScaler
    if not any(c > 0 for c in hist.values()) and finding.data.get("flushed") != 1.0:
        return None  # no gradient recorded to size a scale from
    had_scaler = ctx.scaler
    current = ctx.initial_scale() if had_scaler else None
    choice = choose_init_scale(hist, fmt, current)
    k_now = choice.current.k
    if had_scaler and choice.k == k_now:
        return None
    now_label = f"at 2^{k_now}" + (
        " (the run's init_scale)" if had_scaler else " (GradScaler's default)"
    )
    evidence = []
    if not had_scaler and choice.headroom is not None:
        plain = scale_fractions(hist, fmt, 0)
        evidence.append(
            f"{source}, {plain.total} non-zero values, without a loss scale: {_fractions(plain)}"
        )
    if choice.headroom is None:
        evidence.append(
            "no non-zero gradient was recorded to size the scale from: start at "
            f"2^{choice.k}; GradScaler doubles it after every growth_interval clean steps"
        )
    else:
        evidence += [
            f"{source}, {choice.current.total} non-zero values: {now_label}: "
            f"{_fractions(choice.current)}",
            f"at 2^{choice.k}: {_fractions(choice.chosen)}; the largest gradient sits "
            f"{choice.headroom} binades below {fmt.name}'s max binade",
        ]
    interval, why = _growth_interval(trace)
    evidence.append(why)
    dev = _device_type(trace)
    line = (
        f'scaler = torch.amp.GradScaler("{dev}", init_scale=2.0**{choice.k}, '
        f"growth_interval={interval})"
    )
    if had_scaler:
        snippet = f"import torch\n\n{line}"
    else:
        fp_params = any(
            layer.param_grad is not None and layer.param_grad.dtype == fmt.name
            for layer in trace.layers
        )
        lines = ["import torch", ""]
        if fp_params:
            evidence.append(
                f"the parameters are {fmt.name}: GradScaler cannot unscale {fmt.name} gradients, "
                "so keep float32 weights and let autocast run the layers in "
                f"{fmt.name}"
            )
            lines.append("model.float()  # float32 weights; autocast computes in half precision")
        lines += [
            line,
            "",
            f'with torch.autocast("{dev}", dtype={_torch_dtype(fmt)}):',
            "    loss = loss_fn(model(inputs), targets)",
            "scaler.scale(loss).backward()",
            "scaler.step(optimizer)",
            "scaler.update()",
        ]
        snippet = "\n".join(lines)
    return Recommendation(
        type="init_scale",
        value=choice.scale,
        snippet=snippet,
        evidence=evidence,
        data={
            "k": choice.k,
            "current_k": k_now,
            "growth_interval": interval,
            "histogram": source,
            "current": _fraction_dict(choice.current),
            "chosen": _fraction_dict(choice.chosen),
        },
    )


def _fraction_dict(fr: ScaleFractions) -> dict[str, float]:
    return {
        "overflow": fr.overflow,
        "normal": fr.normal,
        "subnormal": fr.subnormal,
        "flushed": fr.flushed,
    }


def _growth_interval(trace: Trace) -> tuple[int, str]:
    """growth_interval: the default, or longer when growth attempts kept backing off."""
    events = sorted(trace.scaler_events, key=lambda e: e.step)
    cycles = [
        (a, b)
        for a, b in itertools.pairwise(events)
        if a.event == "growth" and b.event == "backoff"
    ]
    growths = [e.step for e in events if e.event == "growth"]
    if len(cycles) >= 2 and len(growths) >= 2:
        gaps = [b - a for a, b in itertools.pairwise(growths) if b > a]
        spacing = sorted(gaps)[len(gaps) // 2] if gaps else DEFAULT_GROWTH_INTERVAL
        interval = int(nice_ceil(2 * spacing))
        return interval, (
            f"{len(cycles)} growths were undone by a backoff at the next overflow: "
            f"growth_interval={interval} (twice the {spacing}-step spacing of growths) tries "
            "half as often"
        )
    own = (trace.run.scaler_settings or {}).get("growth_interval")
    if own is not None and int(own) != DEFAULT_GROWTH_INTERVAL:
        return int(own), (
            f"growth_interval={int(own)} (the script's own), kept: only the init_scale changes"
        )
    return DEFAULT_GROWTH_INTERVAL, (
        f"growth_interval={DEFAULT_GROWTH_INTERVAL} (the default): the scaler still doubles the "
        "scale after that many clean steps and backs off, skipping one step, if it overflows"
    )


def _fp32_targets(trace: Trace, ctx: Context, finding: Finding) -> tuple[str, list[str]] | None:
    """The name or pattern to run in float32 and the instances at risk."""
    if finding.rule.startswith("near-overflow"):
        modules = list(finding.data.get("modules") or ([finding.module] if finding.module else []))
        if not modules:
            return None
        return (finding.module or modules[0]), modules
    name = finding.module
    layer = ctx.layer(name) if name else None
    if layer is None:
        return None
    pattern = module_pattern(name)
    at_risk = [name]
    for other in trace.layers:
        if other.module == name or other.type != layer.type:
            continue
        if module_pattern(other.module) != pattern:
            continue
        peak = ctx.forward_peak(other)
        if peak is not None and ctx.fmt.headroom_binades(peak[1]) < ctx.th.near_max:
            at_risk.append(other.module)
    return (pattern if len(at_risk) >= 2 else name), at_risk


def _region_end(ctx: Context, name: str) -> tuple[LayerStats, list[str]] | None:
    """The next normalisation after ``name`` in execution order (containers of ``name`` and
    pass-through copies skipped), and the modules between."""
    start = ctx.order.get(name)
    if start is None:
        return None
    layers = ctx.trace.layers
    culprit = layers[start]
    between = []
    for layer in layers[start + 1 :]:
        if ctx.is_descendant(name, layer.module):
            continue
        if layer.forward_amax_by_step == culprit.forward_amax_by_step:
            continue
        if is_norm_type(layer.type):
            return layer, between
        if is_loss_type(layer.type):
            return None
        between.append(layer.module)
    return None


def _fp32_module(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    fmt = ctx.fmt
    if finding.rule == "loss-nan-op":
        return _fp32_probabilities(trace, ctx, finding)
    if (finding.rule == "scale-collapse" or finding.data.get("collapse")) \
            and not finding.data.get("overflow"):
        return None  # NaN made in backward: float32 does not make sqrt'(0) finite
    targets = _fp32_targets(trace, ctx, finding)
    if targets is None:
        return None
    target, instances = targets
    first = ctx.layer(instances[0])
    if finding.kind == "nan_op" and not _narrow_dtype(first, fmt):
        return None  # already in float32: float32 will not help
    evidence = []
    if len(instances) > 1:
        evidence.append(
            f"{len(instances)} instances of {target} are within {ctx.th.near_max:g} binades of "
            f"{fmt.name}'s max or past it: {', '.join(instances[:4])}"
        )
    else:
        siblings = _sibling_headroom(trace, ctx, instances[0])
        if siblings:
            evidence.append(siblings)
    cast = _torch_dtype(fmt) if _narrow_dtype(first, fmt) else None
    exceeds = False
    f = trace.first_failure
    if finding.severity == "error" and f is not None and f.module == instances[0]:
        s = f.stats
        exceeds = finding.kind == "overflow" and f.phase == "forward" and bool(s.posinf or s.neginf)
        if exceeds:
            evidence.append(
                f"its {fmt.name} output held {s.posinf} +inf and {s.neginf} -inf: the float32 "
                f"values exceed {fmt.max:g}, so casting them back makes inf again"
            )
    elif finding.data.get("headroom", 0.0) < 0:
        exceeds = True
        evidence.append(f"its float32 values exceed {fmt.max:g}: casting them back makes inf")
    region = None
    ends: list[str] = []
    if exceeds:
        found = _region_ends(ctx, target, instances[0])
        if found is None:
            evidence.append(
                "no normalisation follows it in the trace: keep float32 until values are back "
                f"below {fmt.max:g}, or clamp (see the clamp recommendation)"
            )
            cast = None  # its output stays float32 for what follows
        else:
            end, between, ends = found
            peak = ctx.forward_peak(end)
            back = f" (amax {_n(peak[1])} at step {peak[0]})" if peak else ""
            region = [target, *between, *ends]
            others = [e for e in ends if e != _same_shape(target, instances[0], end.module)]
            evidence.append(
                f"the float32 region must run through {end.module} ({end.type}), the next "
                f"normalisation, where values are back in range{back}; cast back after it"
                + (f"; for the other instances of {target}, through "
                   f"{', '.join(others)}" if others else "")
            )
    evidence.append(
        "float32 for these instances only, not the whole class; autocast stays on elsewhere"
    )
    value = target if region is None else region
    return Recommendation(
        type="fp32_module",
        value=value,
        module=target,
        snippet="",  # written from its --fix spec (nanhunt.fixspec) by remedies, below
        evidence=evidence,
        data={
            "modules": instances,
            "region": region or [target],
            "cast_to": fmt.name if cast else None,
            **({"region_ends": len(ends)} if len(ends) > 1 else {}),
        },
    )


def _region_ends(ctx: Context, target: str, first: str
                 ) -> tuple[LayerStats, list[str], list[str]] | None:
    """Where the float32 region of ``target`` ends: ``first``'s end (the next normalisation),
    the modules between (``first``'s, where its values exceed the format) and an end for every
    instance ``target`` runs in float32, in execution order (``blocks.*.ln_1`` for all blocks
    but the last, ``ln_f`` after the last one), so that none stays float32 to the end."""
    found = _region_end(ctx, first)
    if found is None:
        return None
    end, between = found
    between = [_same_shape(target, first, m) for m in between]
    if target == first:
        return end, between, [end.module]
    kind = ctx.layer(first)
    ends: list[str] = []
    for layer in ctx.trace.layers:
        if not fnmatch.fnmatchcase(layer.module, target) or (
                kind is not None and layer.type != kind.type):
            continue
        one = end if layer.module == first else (_region_end(ctx, layer.module) or [None])[0]
        if one is not None:  # (none: its values stay float32, never cast back to overflow)
            ends.append(one.module)
    ends.sort(key=lambda m: ctx.order.get(m, len(ctx.order)))
    return end, _generalise(between), _generalise(
        [_same_shape(target, first, m) if m == end.module else m for m in ends])


def _generalise(names: list[str]) -> list[str]:
    """``names`` in order without repeats, where two or more instances of one pattern
    (``h.1.ln_1``, ``h.2.ln_1``) become the pattern (``h.*.ln_1``)."""
    by_pattern: dict[str, set[str]] = {}
    for n in names:
        by_pattern.setdefault(module_pattern(n), set()).add(n)
    out: list[str] = []
    for n in names:
        p = module_pattern(n)
        name = p if len(by_pattern[p]) > 1 else n
        if name not in out:
            out.append(name)
    return out


def _same_shape(pattern: str, instance: str, other: str) -> str:
    """``other`` as a pattern when ``pattern`` generalises ``instance`` the same way
    (``encoder.blocks.*.norm`` for ``encoder.blocks.1.norm``)."""
    if pattern == instance:
        return other
    p = module_pattern(other)
    return p if p != other and instance.startswith(other.rsplit(".", 1)[0]) else other


def _sibling_headroom(trace: Trace, ctx: Context, name: str) -> str | None:
    layer = ctx.layer(name)
    if layer is None:
        return None
    pattern = module_pattern(name)
    if pattern == name:
        return None
    parts = []
    for other in trace.layers:
        if other.module == name or other.type != layer.type:
            continue
        if module_pattern(other.module) != pattern:
            continue
        peak = ctx.forward_peak(other)
        if peak is not None:
            h = ctx.fmt.headroom_binades(peak[1])
            parts.append(f"{other.module} peaks at {_n(peak[1])} ({h:.1f} binades of headroom)")
    if not parts:
        return None
    return f"other instances of {pattern} are not at risk: " + "; ".join(parts[:3])


def _fp32_probabilities(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    """For log(0) in a loss: compute the probabilities in float32, where they do not round to 0."""
    name = finding.data.get("input_module")
    layer = ctx.layer(name) if name else None
    if not finding.data.get("probabilities") or layer is None or not _narrow_dtype(layer, ctx.fmt):
        return None
    fwd = layer.forward
    evidence = [
        f"{name} ({layer.type}) ran in {ctx.fmt.name} and held {fwd.zero if fwd else 0} exact "
        f"zeros: probabilities below {ctx.fmt.smallest_subnormal:.3g} round to 0 in "
        f"{ctx.fmt.name}, not in float32",
        "better still: compute the loss from logits (log_softmax, cross_entropy), which never "
        "takes log(0)",
    ]
    return Recommendation(
        type="fp32_module",
        value=name,
        module=name,
        snippet="",  # written from its --fix spec by remedies, below
        evidence=evidence,
        data={"modules": [name], "region": [name], "cast_to": None},
    )


def _clamp(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    f = trace.first_failure
    if finding.severity != "error" or f is None:
        return None
    fmt = ctx.fmt
    if finding.rule == "forward-overflow":
        s = f.stats
        if s.nan or not (s.posinf or s.neginf) or not f.module:
            return None  # clamp turns inf into a finite value; NaN stays NaN
        value = fmt.max - min(_T5_CLAMP_MARGIN, fmt.max / 64)
        target = _fp32_targets(trace, ctx, finding)
        pattern = target[0] if target else f.module
        inf = s.posinf + s.neginf
        snippet = "\n".join(
            [
                "import fnmatch",
                "",
                "import torch",
                "",
                f"CLAMP_VALUE = {value!r}  # {fmt.name}'s max ({fmt.max:g}) less T5's margin",
                "",
                "",
                "def clamp_output(module, args, output):",
                f"    if torch.is_tensor(output) and output.dtype == {_torch_dtype(fmt)}:",
                "        return output.clamp(-CLAMP_VALUE, CLAMP_VALUE)",
                "    return output",
                "",
                "",
                "for name, module in model.named_modules():",
                f"    if fnmatch.fnmatchcase(name, {_q(pattern)}):",
                "        module.register_forward_hook(clamp_output)",
            ]
        )
        return Recommendation(
            type="clamp",
            value=value,
            module=pattern,
            snippet=snippet,
            evidence=[
                f"{inf} of {s.numel} values ({_pct(inf / s.numel)}) of {f.module}'s output were "
                f"±inf at step {f.step}: clamping replaces them with ±{value:g}, which changes "
                "what the next layers see",
                "it bounds the symptom; running the module in float32 keeps the values",
            ],
            data={"where": "output", "bound": value},
        )
    if finding.rule == "loss-nan-op" and finding.data.get("probabilities"):
        value = fmt.smallest_normal
        ref = _module_ref(ctx, f.module) if f.module else None
        if ref is None:
            return None
        snippet = "\n".join(
            [
                "import torch",
                "",
                "",
                "def keep_probabilities_positive(module, args):",
                f"    # log(0) = -inf: keep probabilities at or above {fmt.name}'s smallest normal",
                "    return tuple(",
                f"        a.clamp_min({value!r}) if torch.is_tensor(a) and a.is_floating_point() "
                "else a",
                "        for a in args",
                "    )",
                "",
                "",
                f"{ref}.register_forward_pre_hook(keep_probabilities_positive)",
            ]
        )
        return Recommendation(
            type="clamp",
            value=value,
            module=f.module,
            snippet=snippet,
            evidence=[
                f"{finding.data.get('input_module')} feeds {f.module} probabilities that reach 0",
                f"clamped at {value:.3g}, each sample's -log(p) is at most {-math.log(value):.3g}",
            ],
            data={"where": "input", "min": value},
        )
    op = failure_op(trace)
    if f.phase in ("backward", "loss_scaling") and f.source_line:
        # the backward op (a div for sqrt's derivative) is not what the user wrote: the
        # forward call on that line is where the clamp goes
        m = _FORWARD_CALL.search(f.source_line)
        op = m.group(1) if m else op
    template = _OP_CLAMPS.get(op or "")
    invalid = finding.kind == "nan_op" or (
        finding.rule == "scale-collapse" and not finding.data.get("overflow")
    )
    if invalid and template:
        value = fmt.smallest_normal
        where = f"{f.source}: {f.source_line.strip()}" if f.source and f.source_line else None
        lines = [f"# {where}"] if where else [f"# where {f.module or 'the code'} calls {op}:"]
        lines.append(template.format(v=repr(value)))
        return Recommendation(
            type="clamp",
            value=value,
            module=f.module or None,
            snippet="\n".join(lines),
            evidence=[
                f"aten.{op} made the first non-finite value from finite inputs; keeping its "
                f"input at or above {value:.3g} ({fmt.name}'s smallest normal) keeps it finite"
            ],
            data={"where": "op_input", "op": op, "min": value},
        )
    return None


_FORWARD_CALL = re.compile(r"\b(sqrt|rsqrt|log10|log2|log|reciprocal|pow)\s*\(")

_OP_CLAMPS = {
    "log": "y = torch.log(x.clamp_min({v}))",
    "log2": "y = torch.log2(x.clamp_min({v}))",
    "log10": "y = torch.log10(x.clamp_min({v}))",
    "sqrt": "y = torch.sqrt(x.clamp_min({v}))",
    "rsqrt": "y = torch.rsqrt(x.clamp_min({v}))",
    "reciprocal": "y = torch.reciprocal(x.clamp_min({v}))",
    "div": "y = a / b.clamp_min({v})  # b >= 0; for a signed b: b + torch.where(b < 0, -{v}, {v})",
    "pow": "y = x.clamp_min({v}) ** p",
}


def _eps(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    fmt = ctx.fmt
    value = suggest_eps(fmt)
    if eps_in_format(value, fmt) != "normal":
        return None

    def becomes(label: str) -> str:
        eps = _EPS_DEFAULTS[label]
        return f"{label} {eps:g} is {eps_in_format(eps, fmt)} in {fmt.name}"

    tail = f"{value:g} is the smallest power of ten that is a normal {fmt.name} number"
    user_eps = finding.data.get("eps")
    theirs = []
    if isinstance(user_eps, (int, float)) and user_eps > 0:
        fmt_of = get_format(finding.data.get("dtype") or fmt.name) if finding.rule == \
            "norm-eps" else fmt
        theirs = [f"your eps {user_eps:g} is {eps_in_format(user_eps, fmt_of)} in {fmt_of.name}"]
    if finding.rule == "optimizer-eps":
        if not theirs and eps_in_format(_EPS_DEFAULTS[_ADAM], fmt) == "normal":
            return None
        return Recommendation(
            type="eps",
            value=value,
            module=finding.module,
            snippet="\n".join(
                [
                    "for group in optimizer.param_groups:",
                    f'    group["eps"] = {value!r}  # nonzero in {fmt.name}',
                ]
            ),
            evidence=[
                *(theirs or [becomes(_ADAM)]),
                tail,
                "better still: keep float32 weights (autocast + "
                "GradScaler), where the optimizer runs in float32",
            ],
            data={"where": "optimizer"},
        )
    name = finding.module
    layer = ctx.layer(name) if name else None
    if layer is None or not is_norm_type(layer.type) or not _narrow_dtype(layer, fmt):
        return None
    ref = _module_ref(ctx, name)
    snippet = "\n".join(
        [
            f"norm = {ref}",
            "for attr in (" + ", ".join(_q(a) for a in _EPS_ATTRS) + "):",
            "    if hasattr(norm, attr):",
            f"        setattr(norm, attr, {value!r})  # a normal {fmt.name} number",
        ]
    )
    return Recommendation(
        type="eps",
        value=value,
        module=name,
        snippet=snippet,
        evidence=[
            f"{name} ({layer.type}) ran in {fmt.name}",
            *theirs,
            *(becomes(label) for label in _EPS_DEFAULTS if label != _ADAM),
            tail,
        ],
        data={"where": "module", "attrs": list(_EPS_ATTRS)},
    )


def _healthy_norms(ctx: Context, trace: Trace) -> tuple[list[tuple[int, float]], int | None]:
    """Gradient norms before growth or a spike began, and where it began."""
    norms = ctx.grad_norms(include_failure=False)
    start = None
    for w in [trace.diagnosis, *trace.warnings]:
        if w is not None and w.rule == "exploding-gradient" and "from_step" in w.data:
            start = int(w.data["from_step"])
            spike = "spike" in w.data
            cut = [(s, v) for s, v in norms if s < start or (s == start and not spike)]
            return cut, start
    return norms, start


def _clip_grad_norm(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    if finding.rule == "scale-collapse" and not finding.data.get("overflow"):
        return None  # clipping a NaN gradient leaves it NaN
    healthy, start = _healthy_norms(ctx, trace)
    value = clip_value([v for _, v in healthy], _CLIP_PERCENTILE)
    if value is None and finding.kind == "exploding_gradient":
        value = 1.0
        evidence = [
            "no step before the gradients grew was recorded to size max_norm from: "
            "max_norm=1.0 (a common default); once the run is stable, set it near the "
            "largest gradient norm of healthy steps"
        ]
        healthy = []
    if value is None:
        return None
    vals = sorted(v for _, v in healthy)
    if healthy:
        evidence = [
            f"gradient norm over {len(vals)} healthy step{'s' if len(vals) != 1 else ''} "
            f"({_span(healthy)}): median {_n(statistics.median(vals))}, "
            f"largest {_n(vals[-1])}",
            f"max_norm={value:g}: the {_CLIP_PERCENTILE:g}th percentile of those, rounded up",
        ]
    later = [v for s, v in ctx.grad_norms() if start is not None and s > start]
    if later:
        evidence.append(f"afterwards it reached {_n(max(later))}")
    if ctx.scaler:
        lines = [
            "scaler.scale(loss).backward()",
            "scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones",
            f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={value!r})",
            "scaler.step(optimizer)",
            "scaler.update()",
        ]
    else:
        lines = [
            "loss.backward()",
            f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={value!r})",
            "optimizer.step()",
        ]
    return Recommendation(
        type="clip_grad_norm",
        value=value,
        snippet="import torch\n\n" + "\n".join(lines),
        evidence=evidence,
        data={"percentile": _CLIP_PERCENTILE, "healthy_steps": [s for s, _ in healthy]},
    )


def _lower_lr(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    g = finding.data.get("growth_per_step")
    weights = finding.rule in ("weight-growth", "optimizer-update")
    what = "the largest |weight|" if weights else "the gradient norm"
    factor = lr_factor(g) if g else 0.1  # a spike, no steady rate: a tenfold cut
    evidence = []
    adaptive = finding.data.get("lr_factor")
    if adaptive:  # an adaptive optimizer: its step is lr, so the cut is sized from lr itself
        factor = float(adaptive)
        evidence.append(
            f"{finding.data.get('optimizer')} changes a weight by about lr a step; the weights "
            f"moved +{_n(float(finding.data.get('increment', 0.0)))} a step, so x{factor:g} "
            f"(lr={float(finding.data.get('lr', 0.0)) * factor:g}) brings that to about "
            "0.1% of their size")
    elif g:
        evidence.append(f"{what} grew about {g:.3g}x a step, +{_pct(g - 1)} a step")
        evidence.append(
            f"if the change a step scales with the learning rate, x{factor:g} brings it to "
            f"about +{_pct((g - 1) * factor)} a step"
        )
    else:
        evidence.append("no steady growth rate to size the cut from: a tenfold cut to start with")
    snippet = "\n".join(
        [
            "for group in optimizer.param_groups:",
            f'    group["lr"] *= {factor!r}',
        ]
    )
    return Recommendation(
        type="lower_lr",
        value=factor,
        module=finding.module,
        snippet=snippet,
        data={"growth_per_step": g},
        evidence=evidence,
    )


def _normalize_input(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    shift = next(
        (
            w
            for w in [trace.diagnosis, *trace.warnings]
            if w is not None and w.rule == "input-range-shift"
        ),
        None,
    )
    evidence = []
    value: dict[str, object]
    if finding.rule == "input-range":
        return _normalize_raw_input(finding)
    if finding.rule == "bad-input":
        amax = float(finding.data.get("amax", 0.0))
        if not (amax > 0 and ctx.fmt.headroom_binades(amax) < ctx.th.large) or is_sentinel(amax):
            return None
        value = {"module": finding.module, "amax": amax}
        evidence.append(f"besides NaN/Inf, the batch's finite values reach {_n(amax)}")
    elif shift is not None:
        value = {"module": shift.module, "step": shift.step, "jump": round(shift.data["ratio"], 3)}
        evidence += shift.evidence
    elif finding.rule == "forward-overflow" and "input_module" not in finding.data:
        value = {"module": finding.module}
        evidence.append(f"{finding.module} is the first module: its input is the batch")
    else:
        return None
    evidence.append(
        "standardised inputs keep the first layers' outputs on the scale they were trained on"
    )
    snippet = "\n".join(
        [
            "import torch",
            "",
            "",
            "def standardize(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> "
            "torch.Tensor:",
            '    """Inputs on one scale, whichever shard they came from."""',
            "    return (x - mean) / std.clamp_min(1e-6)",
            "",
            "",
            "# once, from the training data: mean, std = train_x.mean(dim=0), train_x.std(dim=0)",
            "# per batch, before the model:   x = standardize(x, mean, std)",
        ]
    )
    return Recommendation(
        type="normalize_input",
        value=value,
        module=str(value["module"]),
        snippet=snippet,
        evidence=evidence,
    )


#: full-scale values of integer pixel formats (8, 10, 12, 14 and 16 bits)
_PIXEL_FULL_SCALE = (255.0, 1023.0, 4095.0, 16383.0, 65535.0)


def _normalize_raw_input(finding: Finding) -> Recommendation:
    """Raw counts or unscaled features: divide by the full scale or standardise, before the
    model; the mean and std measured on the failing batch are the starting point."""
    d = finding.data
    lo, hi, mean, std = (float(d[k]) for k in ("min", "max", "mean", "std"))
    full = next((f for f in _PIXEL_FULL_SCALE if lo >= 0 and hi <= f and hi > f / 2), None)
    evidence = [
        f"{finding.module}'s {d.get('path', 'input')} ranged from {lo:.4g} to {hi:.4g} "
        f"(mean {mean:.4g}, std {std:.4g}) in the failing batch",
        "normalise first: a float32 region or a clamp only hides an input on the wrong scale",
    ]
    if full is not None:
        evidence.append(f"non-negative values up to {hi:.4g}: {int(full).bit_length()}-bit counts "
                        f"whose full scale is {full:g}")
        lines = [
            f"x = x.float() / {full!r}  # {int(full).bit_length()}-bit counts to [0, 1]",
            "# better: standardise with the training set's statistics, measured once:",
            "# mean, std = train_x.float().div(" + repr(full) + ").mean(), "
            "train_x.float().div(" + repr(full) + ").std()",
            "# x = (x - mean) / std",
        ]
    else:
        lines = [
            "# once, from the training data (per feature):",
            "mean, std = train_x.mean(dim=0), train_x.std(dim=0).clamp_min(1e-6)",
            "# per batch, before the model:",
            "x = (x - mean) / std",
        ]
    return Recommendation(
        type="normalize_input",
        value={"module": finding.module, "min": lo, "max": hi, "scale": full},
        module=finding.module,
        snippet="\n".join(lines),
        evidence=evidence,
        data={"mean": mean, "std": std, "scale": full},
    )


def _fp32_master_weights(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    """Optimizer arithmetic in float16 (a .half() model): keep float32 weights and let autocast
    run the forward in float16; the optimizer's eps and small updates then exist."""
    if finding.data.get("dtype") not in ("float16", "float8_e4m3fn", "float8_e5m2"):
        return None
    device = _device_type(trace)
    snippet = "\n".join([
        "import torch",
        "",
        "model = model.float()  # master weights in float32: drop model.half()",
        f'scaler = torch.amp.GradScaler("{device}")',
        "# in the training loop:",
        f'with torch.autocast("{device}", dtype=torch.float16):',
        "    loss = loss_fn(model(inputs), targets)",
        "optimizer.zero_grad()",
        "scaler.scale(loss).backward()",
        "scaler.step(optimizer)",
        "scaler.update()",
    ])
    return Recommendation(
        type="fp32_master_weights",
        value=finding.data.get("optimizer"),
        module=finding.module,
        snippet=snippet,
        evidence=[
            f"the parameters the optimizer steps are {finding.data.get('dtype')}: its state "
            "(m, v) and its eps live in that format too",
            "with float32 weights the optimizer computes in float32, and autocast still runs "
            "matmuls and convolutions in float16",
            "or keep the whole model in float32: model.float(), the forward under "
            "torch.autocast with a GradScaler",
        ],
    )


def _finfo_constant(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    from nanhunt.analyse.diagnose.causes import RangeConstant, dtype_expr, find_constants, finfo_fix

    d = finding.data
    line, value, text = d.get("source_line"), d.get("constant"), d.get("text")
    fmt = get_format(d.get("dtype") or ctx.fmt.name)
    bound = "min" if isinstance(value, (int, float)) and value < 0 else "max"
    where = f"# {d.get('source')}: {line.strip()}\n" if line else ""
    literal = bool(line and text) and any(c.text == text for c in find_constants(line, fmt))
    if literal:
        fixed = finfo_fix(line, RangeConstant(value, text), fmt)
    elif line and text and isinstance(value, (int, float)):  # a variable holds it
        dtype = dtype_expr(line.strip(), RangeConstant(value, text)) or f"torch.{fmt.name}"
        fixed = f"{text} = torch.finfo({dtype}).{bound}  # where {text} is set"
    else:
        fixed = f"fill = torch.finfo(tensor.dtype).{bound}  # the tensor the constant goes into"
    others = "negative" if bound == "min" else "positive"
    return Recommendation(
        type="finfo_constant",
        value=value,
        module=finding.module,
        snippet=f"import torch\n\n{where}{fixed}",
        evidence=[
            f"torch.finfo(torch.{fmt.name}).{bound} = {-fmt.max if bound == 'min' else fmt.max:g}"
            f", the most {others} {fmt.name} number; torch.finfo(tensor.dtype) fits whatever "
            "the tensor's format is (float32 in a float32 run, float16 under autocast or "
            ".half())",
            *(["a softmax still gives a masked position weight 0 with finfo.min, and no NaN "
               "when a whole row is masked, as -inf would"] if bound == "min" else []),
        ],
        data={"bound": bound, "dtype": fmt.name},
    )


def _fix_mask(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    """A softmax over a row masked throughout (NaN from -inf inputs, in any precision): the
    mask must leave every row something to attend to, or use a finite fill."""
    if not finding.data.get("masked_row"):
        return None
    f = trace.first_failure
    where = f" ({f.source})" if f is not None and f.source else ""
    snippet = "\n".join([
        "import torch",
        "",
        "# every query must keep at least one key it may attend to: a row masked throughout",
        "# is 0/0 in softmax, in any precision (a query that is padding, an off-by-one window)",
        "assert not mask.all(dim=-1).any(), \"a query row has no key left to attend to\"",
        "",
        "# or keep such rows finite: mask with the dtype's lowest value instead of -inf (the",
        "# row then attends uniformly), and zero what those rows produce",
        "scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)",
    ])
    return Recommendation(
        type="fix_mask", value="a row masked throughout", module=finding.module or None,
        snippet=snippet,
        code_change=True,
        evidence=[f"the softmax{where} got a row whose every entry was -inf: its attention "
                  "mask blocks every position of that row",
                  "float32 does not help (exp(-inf) is 0 in every format): the mask or the "
                  "batch does (a fully padded sequence, an off-by-one window)"],
        data={"op": finding.data.get("op"), "input_inf": finding.data.get("nan_from_inf")})


def _fix_data(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    samples: dict[str, list[int]] = dict(finding.data.get("samples") or {})
    step = finding.step
    evidence = [f"step {step}: {finding.tensor} of {finding.module} carried NaN/Inf"]
    for path, idx in samples.items():
        evidence.append(
            f"{path}: batch positions {', '.join(map(str, idx[:10]))}"
            + (" ..." if len(idx) > 10 else "")
        )
    seen = "; ".join(f"{p}: {idx[:10]}" for p, idx in samples.items()) or finding.tensor or ""
    snippet = "\n".join(
        [
            "import torch",
            "",
            "",
            "def nonfinite_samples(batch: torch.Tensor) -> list:",
            '    """Batch positions whose values hold NaN or Inf."""',
            "    bad = ~torch.isfinite(batch.reshape(batch.shape[0], -1)).all(dim=1)",
            "    return bad.nonzero().flatten().tolist()",
            "",
            "",
            f"# nanhunt saw step {step}: {seen}",
            "# in the training loop, before the model:",
            "#     bad = nonfinite_samples(x)",
            "#     if bad:",
            '#         print(f"step {step}: skipping a batch with non-finite samples {bad}")',
            "#         continue",
        ]
    )
    return Recommendation(
        type="fix_data",
        value={"step": step, "samples": samples},
        module=finding.module,
        snippet=snippet,
        evidence=evidence,
    )


#: Which recommendations answer which rule, most relevant first.
_SCALER_LOOP = """\
with torch.autocast(device_type, dtype=torch.float16):
    loss = loss_fn(model(inputs), targets)
optimizer.zero_grad()
scaler.scale(loss).backward()   # gradients multiplied by the scale
scaler.unscale_(optimizer)      # optional: only if you clip or inspect gradients
torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
scaler.step(optimizer)          # unscales (if not yet), skips the step on inf/NaN
scaler.update()                 # backs off or grows the scale"""


def _skip_init_scale(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    """The init_scale the skip-streak rule computed (where calibration settled, capped by the
    gradients' exponents), and the scheduler stepped only after applied steps when it ran on
    skipped ones."""
    k = finding.data.get("init_k")
    if k is None:
        return None
    dev = _device_type(trace)
    lines = ["import torch", "", f'scaler = torch.amp.GradScaler("{dev}", init_scale=2.0**{k})']
    evidence = [finding.message, *finding.evidence]
    if finding.data.get("scheduler_steps"):
        lines += [
            "# in the loop:",
            "scale = scaler.get_scale()",
            "scaler.step(optimizer)",
            "scaler.update()",
            "if scaler.get_scale() >= scale:  # applied: a skipped step lowers the scale",
            "    scheduler.step()",
        ]
        evidence.append("step the LR scheduler only after steps GradScaler applied")
    if finding.data.get("summed_loss"):
        evidence.append('or average the loss (reduction="mean"): summed losses need a scale '
                        "divided by the number of elements")
    return Recommendation(type="init_scale", value=2.0**k, snippet="\n".join(lines),
                          evidence=evidence, data={"k": k})


def _scaler_usage(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    code = finding.data.get("misuse")
    if not code:
        return None
    return Recommendation(
        type="scaler_usage",
        value=code,
        snippet=_SCALER_LOOP,
        evidence=[finding.message, *finding.evidence],
        data={"misuse": code},
    )


def _comm_hook(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    """bf16_compress_hook for fp16_compress_hook: bfloat16 keeps float32's range."""
    if "fp16_compress_hook" not in trace.run.comm_hooks:
        return None
    if not trace.run.device.startswith(("cuda", "xpu")):
        return None  # DDP refuses bf16_compress_hook without CUDA 11+ and NCCL 2.10+, or XPU
    amax = finding.data.get("local_amax")
    here = f" (amax {_n(amax)} here)" if amax is not None else ""
    return Recommendation(
        type="comm_hook", value="bf16_compress_hook", snippet="",
        evidence=[f"bfloat16's max is {get_format('bfloat16').max:.3g}: the gradients{here} "
                  "fit, at 8 bits of precision instead of float16's 11",
                  "the same halved traffic"],
        data={"hook": "bf16_compress_hook"})


def _no_comm_hook(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    """No compression: DDP all-reduces in the gradients' own dtype."""
    if not trace.run.comm_hooks:
        return None
    evidence = ["DDP's own all-reduce sums the gradients in their own dtype: twice the "
                "traffic of a 16-bit compression"]
    if "fp16_compress_hook" in trace.run.comm_hooks and \
            not trace.run.device.startswith(("cuda", "xpu")):
        evidence.append(f"bf16_compress_hook would keep the traffic halved, but DDP accepts it "
                        f"only with CUDA 11+ and NCCL 2.10+ (or XPU); this run is on "
                        f"{trace.run.device or 'cpu'}")
    return Recommendation(
        type="no_comm_hook", value="no hook", snippet="",
        evidence=evidence,
        data={"hooks": list(trace.run.comm_hooks)})


def _fsdp_unit(trace: Trace, name: str) -> tuple[str, dict] | None:
    """The FSDP2 unit whose policy a module runs under: the innermost unit containing it."""
    best = None
    for unit, policy in trace.run.fsdp_policies.items():
        inside = unit == "" or name == unit or name.startswith(unit + ".")
        if inside and (best is None or len(unit) > len(best[0])):
            best = (unit, policy)
    return best


def _fsdp_reduce_dtype(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    """An FSDP2 reduce-scatter in float16 that overflowed: reduce in float32."""
    if not str(finding.data.get("reduction", "")).startswith("FSDP") or not finding.module:
        return None
    unit = _fsdp_unit(trace, finding.module)
    if unit is None:
        return None
    name, policy = unit
    param = policy.get("param_dtype")
    fsdp1 = policy.get("api") == "FSDP1"
    code = "\n".join([
        "import torch",
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP",
        "from torch.distributed.fsdp import MixedPrecision",
        "",
        "policy = MixedPrecision("
        + (f"param_dtype=torch.{param}, " if param else "") + "reduce_dtype=torch.float32)",
        f"FSDP({'model' if not name else _fsdp_ref(name)}, mixed_precision=policy, ...)  "
        "# and every unit that shares it",
    ]) if fsdp1 else "\n".join([
        "import torch",
        "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard",
        "",
        "policy = MixedPrecisionPolicy("
        + (f"param_dtype=torch.{param}, " if param else "") + "reduce_dtype=torch.float32)",
        f"fully_shard({_fsdp_ref(name)}, mp_policy=policy)  # and every unit that shares it",
    ])
    return Recommendation(
        type="fsdp_policy", value={"reduce_dtype": "float32"}, module=name or None,
        snippet=code, code_change=True,
        evidence=[f"the unit {name or '<root>'} reduce-scatters its gradients in "
                  f"{policy.get('reduce_dtype') or param}; float32 keeps their range"],
        data={"unit": name, "policy": dict(policy), "reduce_dtype": "float32"})


def _fsdp_ref(unit: str) -> str:
    return f"model.get_submodule({_q(unit)})" if unit else "model"


def _fsdp_fp32(rec: Recommendation, trace: Trace) -> Recommendation:
    """Under FSDP2 a module's weights arrive in the policy's ``param_dtype`` whatever autocast
    says, so float32 for a region means its own FSDP2 units with a float32 policy."""
    region = [str(m) for m in rec.data.get("region") or [rec.module]]
    unit = _fsdp_unit(trace, region[0])
    if unit is None:
        return rec
    name, policy = unit
    param = policy.get("param_dtype")
    if param not in ("float16", "bfloat16"):
        return rec  # the policy computes in float32 already: autocast decides
    if policy.get("api") == "FSDP1":
        return _fsdp1_fp32(rec, region, name, param)
    cast = rec.data.get("cast_to")
    lines = [
        "import torch",
        "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard",
        "",
        "# before fully_shard of the modules that contain them (FSDP2 shards bottom-up):",
        "# these compute in float32; the rest keeps its policy",
        "fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)",
    ]
    for i, module in enumerate(region):
        last = i == len(region) - 1
        policy_arg = "fp32"
        if last and cast:
            policy_arg = ("MixedPrecisionPolicy(param_dtype=torch.float32, "
                          f"reduce_dtype=torch.float32, output_dtype=torch.{cast})")
        lines.append(f"fully_shard({_fsdp_ref(module)}, mp_policy={policy_arg})")
    return _policy_change(rec, lines, f"{region[0]} runs in FSDP2 unit {name or '<root>'}, "
                          f"whose MixedPrecisionPolicy casts its weights to {param}: autocast "
                          "cannot change that, the policy must (units of their own, in float32)",
                          {"unit": name, "policy": dict(policy)})


def _policy_change(rec: Recommendation, lines: list[str], why: str,
                   data: dict[str, object]) -> Recommendation:
    """``rec`` (float32 for a region) as a code change to the FSDP policy: ``lines`` of code,
    ``why`` in place of its autocast evidence."""
    rec.type = "fsdp_policy"
    rec.fix = []
    rec.snippet = "\n".join(lines)
    rec.helper = ""
    rec.code_change = True
    rec.evidence = [*rec.evidence[:-1], why]
    rec.data = {**rec.data, **data}
    return rec


def _fsdp1_fp32(rec: Recommendation, region: list[str], unit: str,
                param: str) -> Recommendation:
    """Under FSDP1 a module's weights arrive in its unit's ``MixedPrecision.param_dtype``:
    float32 for a region means units of their own with a float32 MixedPrecision, wrapped
    before the model is (FSDP1 wraps top-down, a unit already wrapped keeps its own), each
    output cast back to the policy's dtype for the modules that follow (their weights stay
    in it)."""
    lines = [
        "import torch",
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP",
        "from torch.distributed.fsdp import MixedPrecision",
        "",
        "# before FSDP(model, ...): these compute in float32 (their inputs cast up), the rest",
        "# keeps its MixedPrecision; pass the same device_id / use_orig_params as for the model",
        "fp32 = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32,",
        "                      cast_forward_inputs=True)",
    ]
    for module in region:
        parent, _, child = module.rpartition(".")
        lines += [
            f"unit = FSDP(model.get_submodule({_q(module)}), mixed_precision=fp32)",
            f"unit.register_forward_hook(lambda m, args, out: out.to(torch.{param}))",
            f"setattr(model.get_submodule({_q(parent)}), {_q(child)}, unit)",
        ]
    return _policy_change(rec, lines, f"{region[0]} runs in FSDP1 unit {unit or '<root>'}, "
                          f"whose MixedPrecision casts its weights to {param}: autocast cannot "
                          "change that, an FSDP unit of its own in float32 can",
                          {"unit": unit, "api": "FSDP1"})


ADVICE: dict[str, tuple[Builder, ...]] = {
    "scaler-crash": (_scaler_usage,),
    "range-constant": (_finfo_constant,),
    "scaler-misuse": (_scaler_usage,),
    "input-range": (_normalize_input, _fp32_module, _clamp),
    "norm-eps": (_eps, _fp32_module),
    "bad-input": (_fix_data, _normalize_input),
    "forward-overflow": (_fp32_module, _normalize_input, _clamp),
    "backward-overflow": (_fp32_module, _init_scale, _clip_grad_norm),
    "loss-nan-op": (_clamp, _fp32_module),
    "forward-nan-op": (_fix_mask, _eps, _clamp, _fp32_module),
    "norm-underflow": (_eps, _fp32_module),
    "backward-nan-op": (_clamp, _eps, _fp32_module),
    "optimizer-update": (_lower_lr, _clip_grad_norm),
    "optimizer-eps": (_eps, _fp32_master_weights),
    "scale-collapse": (_fp32_module, _clamp, _eps, _clip_grad_norm),
    "weight-growth": (_lower_lr, _clip_grad_norm),
    "exploding-gradient": (_clip_grad_norm, _lower_lr),
    "near-overflow-forward": (_fp32_module,),
    "near-overflow-backward": (_fp32_module,),
    "gradient-underflow": (_init_scale,),
    "scale-too-low": (_init_scale,),
    "scale-backoff": (_init_scale,),
    "skip-streak": (_skip_init_scale,),
    "reduction-overflow": (_comm_hook, _no_comm_hook, _fsdp_reduce_dtype),
    "input-range-shift": (_normalize_input,),
    **CURVE_ADVICE,  # failures without a NaN (curve_advice.py)
}


_WHOLE_RUN_CAUSES = ("lr_too_high", "exploding_gradient", "bad_input")
#: rules whose diagnosis is a bug in the loop's code: the symptoms it causes get no advice
_LOOP_BUGS = ("scaler-misuse", "scaler-crash", "range-constant")


def advise(trace: Trace) -> None:
    """Fill ``trace.recommendations`` from the diagnosis and the warnings (not info findings).

    Runs :func:`~nanhunt.analyse.diagnose.diagnose` first when the trace has neither a diagnosis nor
    warnings. One recommendation per (type, module), the diagnosis's first.
    """
    if trace.diagnosis is None and not trace.warnings:
        diagnose(trace)
    ctx = Context(trace)
    findings = [trace.diagnosis] if trace.diagnosis is not None else []
    if trace.diagnosis is None or (trace.diagnosis.kind not in _WHOLE_RUN_CAUSES
                                   and trace.diagnosis.rule not in _LOOP_BUGS):
        # with a cause that acts on the whole run (a learning rate, the data, the scaler),
        # the ranges it pushed to the limit are symptoms: no advice for them
        findings += [w for w in trace.warnings if w.severity == "warning"]
    recs: list[Recommendation] = []
    seen: set[tuple[str, str | None]] = set()
    for finding in findings:
        for build in ADVICE.get(finding.rule, ()):
            rec = build(trace, ctx, finding)
            if rec is None or (rec.type, rec.module) in seen:
                continue
            if rec.type in ("init_scale", "clip_grad_norm", "lower_lr") and any(
                r.type == rec.type for r in recs
            ):
                continue  # one per run: they apply to the whole model
            seen.add((rec.type, rec.module))
            recs.append(rec)
    trace.recommendations = recs
    # every installable recommendation gets its --fix specs and the snippet written from them
    # (one generator: the printed code is the change --fix installs)
    attach_fixes(trace)
    if trace.run.fsdp_policies:  # float32 under FSDP is a policy, not autocast
        trace.recommendations = [_fsdp_fp32(r, trace) if r.type == "fp32_module" else r
                                 for r in trace.recommendations]
