"""Diagnosis: small pure rules over a recorded :class:`~nanhunt.trace.Trace`. Torch-free.

Every rule is a function registered with :func:`rule` under a stable id, with the kind it
diagnoses, a one-line description (its docstring's first line) and the parts of the trace it
needs. :data:`RULES` lists them in the order they run; docs/rules.md is the catalogue.

:func:`diagnose` runs every rule and fills ``trace.diagnosis`` (the one finding with severity
``"error"`` that explains the first failure, chosen by :data:`PRECEDENCE`) and ``trace.warnings``
(ranked by score, worst first). Every number in a finding's evidence is read from the trace.

>>> from nanhunt.trace import Trace
>>> trace = Trace()
>>> diagnose(trace)
>>> trace.diagnosis is None, trace.warnings
(True, [])
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard

from .errors import NanhuntError
from .formats import FORMATS, NumberFormat, get_format
from .trace import Failure, Finding, LayerStats, StepRecord, TensorStats, Trace

__all__ = [
    "KINDS",
    "PRECEDENCE",
    "RULES",
    "Context",
    "Rule",
    "ScaleFractions",
    "Thresholds",
    "diagnose",
    "eps_in_format",
    "failure_op",
    "is_loss_type",
    "is_norm_type",
    "is_sentinel",
    "module_pattern",
    "rule",
    "scale_fractions",
]

KINDS = (
    "overflow",
    "underflow",
    "nan_op",
    "bad_input",
    "exploding_gradient",
    "lr_too_high",
    "loss_scale",
)

#: Which error explains the first failure when several rules fire, first match wins. Root causes
#: upstream of an overflow (weights or gradients growing step over step) outrank the overflow
#: they lead to; an invalid op (log(0)) is not explained by growth, so nan_op rules come first.
PRECEDENCE = (
    "scaler-crash",
    "range-constant",
    "scaler-misuse",
    "bad-input",
    "optimizer-eps",
    "optimizer-update",
    "scale-collapse",
    "norm-eps",
    "loss-nan-op",
    "forward-nan-op",
    "backward-nan-op",
    "norm-underflow",
    "weight-growth",
    "exploding-gradient",
    "input-range",
    "forward-overflow",
    "backward-overflow",
    "skip-streak",  # skips are often a symptom: an explosion or an op above explains them
)

#: Rules whose errors are the diagnosis even when no value went non-finite.
ALWAYS_PRIMARY = ("scaler-crash", "range-constant", "scaler-misuse", "exploding-gradient",
                  "skip-streak")

#: Errors a primary diagnosis explains: they are its consequences, not warnings of their own
#: (a misused GradScaler makes updates that look like a learning rate too high).
SUPERSEDES: dict[str, tuple[str, ...]] = {
    "scaler-misuse": ("optimizer-update", "optimizer-eps", "weight-growth", "backward-overflow"),
    "optimizer-eps": ("optimizer-update",),
    "input-range": ("forward-overflow",),
    "norm-eps": ("forward-nan-op", "backward-nan-op", "norm-underflow"),
}

#: Score of the primary diagnosis; errors that lose to it are kept as warnings with this score.
ERROR_SCORE = 10.0
DEMOTED_SCORE = 8.0

# aten ops (overload and namespace stripped) that make NaN/Inf from finite inputs at special
# points (log(0), sqrt(-1), 1/0), and ops whose non-finite result from finite inputs can only be
# an overflow (sums of products, exponentials)
_NAN_OP_NAMES = """
    log log2 log10 log1p sqrt rsqrt div true_divide reciprocal acos asin atanh acosh xlogy lgamma
    digamma polygamma erfinv fmod remainder
"""
_OVERFLOW_OP_NAMES = """
    mm addmm bmm baddbmm matmul linear einsum conv1d conv2d conv3d convolution _convolution
    cudnn_convolution exp exp2 expm1 sinh cosh mul add sum cumsum square native_layer_norm
    scaled_dot_product_attention _scaled_dot_product_flash_attention
    _scaled_dot_product_efficient_attention linalg_vector_norm norm
"""
_NAN_OPS = frozenset(_NAN_OP_NAMES.split())
_OP_NOISE = frozenset({"aten", "prims", "default", "Tensor", "Scalar", "out"})
_OVERFLOW_OPS = frozenset(_OVERFLOW_OP_NAMES.split())


# ----------------------------------------------------------------------------- small helpers


def module_pattern(name: str) -> str:
    """``encoder.blocks.3.ffn.wo`` -> ``encoder.blocks.*.ffn.wo`` (numbered parts become ``*``)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def is_loss_type(type_name: str) -> bool:
    """Whether a module class name looks like a loss (``CrossEntropyLoss``, ``NLLFromProbs``)."""
    return any(word in type_name for word in ("Loss", "NLL", "CrossEntropy", "Criterion"))


def is_norm_type(type_name: str) -> bool:
    """Whether a module class name looks like a normalisation (``LayerNorm``, ``RMSNorm``)."""
    return "Norm" in type_name


def is_sentinel(value: float) -> bool:
    """A magnitude equal to some format's max: ``finfo.min`` padding or masks, not a real value."""
    return any(value == f.max for f in FORMATS.values())


def eps_in_format(eps: float, fmt: NumberFormat) -> Literal["zero", "subnormal", "normal"]:
    """What ``eps`` becomes when rounded to ``fmt`` (round to nearest, ties to even).

    >>> fp16 = get_format("float16")
    >>> eps_in_format(1e-8, fp16), eps_in_format(1e-5, fp16), eps_in_format(1e-4, fp16)
    ('zero', 'subnormal', 'normal')
    """
    eps = abs(eps)
    if eps >= fmt.smallest_normal:
        return "normal"
    steps = round(eps / fmt.smallest_subnormal)  # subnormals are multiples of the smallest one
    if steps == 0:
        return "zero"
    return "normal" if steps * fmt.smallest_subnormal >= fmt.smallest_normal else "subnormal"


@dataclass(frozen=True)
class ScaleFractions:
    """Where a gradient histogram's mass lands in a format after scaling by ``2**k``."""

    k: int
    total: int
    overflow: float  # e + k above the max binade: inf
    normal: float
    subnormal: float  # fewer significant bits
    flushed: float  # below the smallest subnormal: zero

    @property
    def lost(self) -> float:
        """Subnormal plus flushed: the mass that lost precision or vanished."""
        return self.subnormal + self.flushed


def scale_fractions(hist: dict[int, int], fmt: NumberFormat, k: int) -> ScaleFractions:
    """Fractions of ``hist`` (binade -> count) that overflow, stay normal, become subnormal or
    flush to zero in ``fmt`` when every value is multiplied by ``2**k`` (DESIGN.md §3)."""
    total = sum(c for c in hist.values() if c > 0)
    over = normal = sub = flushed = 0
    for e, c in hist.items():
        if c <= 0:
            continue
        b = e + k
        if b > fmt.max_binade:
            over += c
        elif b >= fmt.min_normal_binade:
            normal += c
        elif b >= fmt.min_subnormal_binade:
            sub += c
        else:
            flushed += c
    if not total:
        return ScaleFractions(k, 0, 0.0, 0.0, 0.0, 0.0)
    return ScaleFractions(k, total, over / total, normal / total, sub / total, flushed / total)


def _n(x: float) -> str:
    """A measured number for evidence text."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.3g}"


def _pct(frac: float) -> str:
    """``0%``, ``<0.01%``, ``0.83%``, ``2.8%``, ``31%``, ``100%``."""
    if frac <= 0:
        return "0%"
    if frac < 0.0001:
        return "<0.01%"
    return f"{100 * frac:.0f}%" if frac >= 0.1 else f"{100 * frac:.2g}%"


def _counts(stats: TensorStats) -> str:
    parts = [
        f"{n} {label}"
        for n, label in ((stats.nan, "NaN"), (stats.posinf, "+inf"), (stats.neginf, "-inf"))
        if n
    ]
    return ", ".join(parts) or "no non-finite values"


def _series(points: list[tuple[int, float]], limit: int = 6) -> str:
    shown = points[-limit:]
    return ", ".join(_n(v) for _, v in shown)


def _span(points: list[tuple[int, float]]) -> str:
    a, b = points[0][0], points[-1][0]
    return f"step {a}" if a == b else f"steps {a}-{b}"


def _finite_pos(v: float | None) -> TypeGuard[float]:
    return v is not None and v > 0 and math.isfinite(v)


@dataclass(frozen=True)
class Growth:
    """Geometric growth of a positive series between two steps."""

    first_step: int
    last_step: int
    first: float
    last: float

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step

    @property
    def total(self) -> float:
        return self.last / self.first

    @property
    def per_step(self) -> float:
        return self.total ** (1 / self.steps) if self.steps > 0 else 1.0


def _trend(points: list[tuple[int, float]]) -> tuple[str, float] | None:
    """How a series grew: steadily (``about 4x a step``) or in its last step (``x4.3 at step 3``),
    with the growth factor per step; None when it did not grow."""
    pts = [(s, v) for s, v in points if _finite_pos(v)]
    if len(pts) < 2:
        return None
    ratios = [b[1] / a[1] for a, b in itertools.pairwise(pts)]
    g = _growth(pts)
    if g is not None and g.steps > 0 and all(r >= 1.1 for r in ratios):
        return f"about {g.per_step:.2g}x a step", g.per_step
    if ratios[-1] >= 1.5:
        return f"x{ratios[-1]:.2g} from step {pts[-2][0]} to {pts[-1][0]}", ratios[-1]
    return None


def _growth(points: list[tuple[int, float]], *, from_min: bool = False) -> Growth | None:
    """Growth from the first point (or the smallest before the last) to the last one."""
    pts = [(s, v) for s, v in points if _finite_pos(v)]
    if len(pts) < 2:
        return None
    last = pts[-1]
    start = min(pts[:-1], key=lambda p: p[1]) if from_min else pts[0]
    return Growth(start[0], last[0], start[1], last[1])


# ----------------------------------------------------------------------------- the context


@dataclass(frozen=True)
class Thresholds:
    """The numbers the rules judge by; docs/rules.md explains each."""

    near_max: float = 2.0  # binades below the max that count as at risk of overflow
    large: float = 4.0  # binades below the max that count as a large magnitude (inputs, weights)
    weight_growth: float = 1.5  # largest |weight| growth per step, sustained over >= 2 steps
    weight_jump: float = 4.0  # ... or in a single step
    weight_floor: float = 1.0  # weights smaller than this are not "blowing up"
    grad_growth: float = 10.0  # gradient-norm growth over the window
    grad_spike: float = 10.0  # a gradient norm this many times the window's median
    loss_spike: float = 5.0  # a loss this many times the window's median
    window: int = 8  # steps looked back over
    underflow: float = 0.5  # fraction of gradient values subnormal or flushed
    flushed: float = 0.1  # fraction of gradient values flushed to zero
    backoffs: int = 3  # GradScaler backoffs after warm-up not explained by a growth attempt
    input_jump: float = 4.0  # first module's output amax jump (vs its median) with steady weights
    raw_input: float = 64.0  # |input| above this is not normalised (z-scores stay within ~10)
    max_warnings: int = 8


#: Growth of the gradient norm that is a problem by itself (two orders of magnitude).
ORDERS = 100.0

#: GradScaler's default init_scale, 2**16 (DESIGN.md §3).
DEFAULT_SCALE_BINADE = 16


class Context:
    """Thresholds plus derived views of one trace that several rules share."""

    def __init__(self, trace: Trace, thresholds: Thresholds | None = None) -> None:
        self.trace = trace
        self.th = thresholds or Thresholds()
        try:
            self.fmt = get_format(trace.run.target or "float16")
        except NanhuntError:  # a report from a newer nanhunt: judge against float16
            self.fmt = FORMATS["float16"]
        self.failure: Failure | None = trace.first_failure
        self.layers: dict[str, LayerStats] = {layer.module: layer for layer in trace.layers}
        self.order: dict[str, int] = {layer.module: i for i, layer in enumerate(trace.layers)}
        self.steps: dict[int, StepRecord] = {s.index: s for s in trace.steps}
        self.scaler = trace.run.scaler or any(s.scale is not None for s in trace.steps)
        self._cache: dict[str, Any] = {}

    # -- steps and scale -------------------------------------------------------------------

    @property
    def fail_step(self) -> int | None:
        return self.failure.step if self.failure is not None else None

    def before_failure(self, step: int) -> bool:
        return self.fail_step is None or step < self.fail_step

    def scale_at(self, step: int) -> float:
        rec = self.steps.get(step)
        s = rec.scale if rec is not None else None
        return s if _finite_pos(s) else 1.0

    def initial_scale(self) -> float | None:
        for s in sorted(self.trace.steps, key=lambda s: s.index):
            if _finite_pos(s.scale):
                return s.scale
        return None

    def current_scale(self) -> float | None:
        """The loss scale in effect after the last recorded step."""
        scaled = [s for s in self.trace.steps if _finite_pos(s.scale)]
        if not scaled:
            return None
        last = max(scaled, key=lambda s: s.index)
        after = [e for e in self.trace.scaler_events if e.step == last.index]
        return after[-1].scale_after if after else last.scale

    def clean_steps(self) -> list[StepRecord]:
        """Steps before the failure that were not skipped."""
        return sorted(
            (s for s in self.trace.steps if self.before_failure(s.index) and not s.skipped),
            key=lambda s: s.index,
        )

    def grad_norms(self, *, include_failure: bool = True) -> list[tuple[int, float]]:
        """Finite gradient norms of steps not skipped, up to the failure step."""
        out = []
        for s in sorted(self.trace.steps, key=lambda s: s.index):
            if self.fail_step is not None and (
                s.index > self.fail_step or (s.index == self.fail_step and not include_failure)
            ):
                continue
            if not s.skipped and _finite_pos(s.grad_norm):
                out.append((s.index, s.grad_norm))
        return out

    # -- layers ----------------------------------------------------------------------------

    def format_of(self, dtype: str) -> NumberFormat:
        """The format a value of ``dtype`` lives in (float64 judged as float32)."""
        if dtype == "float64":
            return FORMATS["float32"]
        return FORMATS.get(dtype, self.fmt)

    def layer(self, name: str) -> LayerStats | None:
        return self.layers.get(name)

    def is_descendant(self, name: str, of: str) -> bool:
        return bool(of) and name.startswith(of + ".")

    def predecessor(self, name: str, step: int) -> tuple[LayerStats, float] | None:
        """The module that ran just before ``name`` (its input, for a sequential model) and its
        forward amax at ``step``. Containers that pass a value through are looked through."""
        idx = self.order.get(name)
        layers = self.trace.layers
        if idx is None:
            idx = len(layers)  # the loss: the last module's output feeds it
        i = idx - 1
        while i >= 0 and self.is_descendant(layers[i].module, name):
            i -= 1
        if i < 0:
            return None
        amax = layers[i].forward_amax_by_step.get(step)
        while i > 0 and amax is not None:
            prev = layers[i - 1].forward_amax_by_step.get(step)
            if prev != amax or self.is_descendant(layers[i - 1].module, name):
                break
            i -= 1
        if amax is None:
            return None
        return layers[i], amax

    def pre_points(
        self, by_step: dict[int, float], *, scaled: bool = False
    ) -> list[tuple[int, float]]:
        """Positive finite values recorded before the failure, unscaled when ``scaled``."""
        out = []
        for step in sorted(by_step):
            v = by_step[step]
            if not self.before_failure(step) or not _finite_pos(v) or is_sentinel(v):
                continue
            out.append((step, v / self.scale_at(step) if scaled else v))
        return out

    def forward_peak(self, layer: LayerStats) -> tuple[int, float] | None:
        """Largest forward amax before the failure (sentinels ignored); for a module that ran
        before the culprit in the failing step, that step counts too."""
        points = self.pre_points(layer.forward_amax_by_step)
        f = self.failure
        if f is not None and f.module in self.order and layer.module in self.order:
            ran_before = self.order[layer.module] < self.order[f.module]
            v = layer.forward_amax_by_step.get(f.step)
            if ran_before and _finite_pos(v) and not is_sentinel(v):
                points.append((f.step, v))
        return max(points, key=lambda p: p[1]) if points else None

    def backward_peak(self, layer: LayerStats) -> tuple[int, float] | None:
        """Largest unscaled gradient amax (w.r.t. its outputs) before the failure."""
        points = self.pre_points(layer.backward_amax_by_step, scaled=True)
        return max(points, key=lambda p: p[1]) if points else None

    def gradient_histogram(self) -> tuple[dict[int, int], str]:
        """The unscaled gradient exponent histogram to judge: gradients stored in the target
        format when there are any, else every gradient."""
        hist = self.trace.grad_hist.get(self.fmt.name)
        if hist:
            return dict(hist), f"{self.fmt.name} gradients"
        merged: dict[int, int] = {}
        for h in self.trace.grad_hist.values():
            for e, c in h.items():
                merged[e] = merged.get(e, 0) + c
        return merged, "all gradients"

    def gradient_shift(self) -> tuple[int, str]:
        """Binades the gradients are shifted by when stored: the loss scale in effect; for a run
        whose gradients are not in a narrow target format and had no scaler, GradScaler's default
        (the scale a user switching to that format would start from)."""
        scale = self.current_scale()
        if scale is not None:
            k = round(math.log2(scale))
            return k, f"at the current loss scale 2^{k}"
        if self.fmt.name in self.trace.grad_hist or not _narrow(self.fmt):
            return 0, "without a loss scale"
        return DEFAULT_SCALE_BINADE, f"at GradScaler's default scale 2^{DEFAULT_SCALE_BINADE}"

    def cached(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


def _narrow(fmt: NumberFormat) -> bool:
    """A format whose exponent range needs loss scaling for gradients (float16, float8)."""
    return fmt.exponent_bits <= 5


# ----------------------------------------------------------------------------- the registry


RuleFunc = Callable[[Trace, Context], Iterable[Finding]]


@dataclass(frozen=True)
class Rule:
    id: str
    kind: str
    needs: tuple[str, ...]
    description: str
    check: RuleFunc = field(repr=False)

    def applicable(self, trace: Trace) -> bool:
        return all(_HAS[need](trace) for need in self.needs)


#: What a rule may need; a rule whose needs the trace lacks is not run.
_HAS: dict[str, Callable[[Trace], bool]] = {
    "first_failure": lambda t: t.first_failure is not None,
    "layers": lambda t: bool(t.layers),
    "steps": lambda t: bool(t.steps),
    "grad_norm": lambda t: any(_finite_pos(s.grad_norm) for s in t.steps),
    "loss": lambda t: any(s.loss is not None for s in t.steps),
    "param_amax": lambda t: any(layer.param_amax_by_step for layer in t.layers),
    "grad_hist": lambda t: any(t.grad_hist.values()),
    "scaler": lambda t: t.run.scaler or any(s.scale is not None for s in t.steps),
}

RULES: list[Rule] = []


def rule(*, id: str, kind: str, needs: tuple[str, ...] = ()) -> Callable[[RuleFunc], RuleFunc]:
    """Register a rule. Its docstring's first line is its description in the catalogue."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    unknown = [n for n in needs if n not in _HAS]
    if unknown:
        raise ValueError(f"unknown needs {unknown}")

    def register(func: RuleFunc) -> RuleFunc:
        if any(r.id == id for r in RULES):
            raise ValueError(f"duplicate rule id {id!r}")
        # the docstring's first paragraph, on one line
        description = " ".join((func.__doc__ or "").strip().split("\n\n")[0].split())
        RULES.append(Rule(id, kind, tuple(needs), description, func))
        return func

    return register


def _finding(severity: str, message: str, evidence: list[str], **kw: Any) -> Finding:
    """A finding whose rule and kind the runner fills in from the rule that made it (unless
    given: a rule may hand its finding to another rule's advice)."""
    return Finding(
        rule=kw.pop("rule", ""),
        kind=kw.pop("kind", ""),
        severity=severity,
        message=message,
        evidence=evidence,
        **kw,
    )


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
    scale = ctx.scale_at(f.step)
    layer = ctx.layer(f.module)
    op = failure_op(ctx.trace)
    evidence = [_describe_failure(f, fmt)]
    if ctx.scaler:
        evidence.append(f"observed at loss scale {scale:g}")
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
    if op in _OVERFLOW_OPS:
        name = "overflow"
    elif op in _NAN_OPS:
        name = "overflow" if "gradient" in large else "nan_op"
    else:
        name = "overflow" if large else "nan_op"
    return _Class(name, fmt, evidence, data)


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
        v = _causes.vanished_eps(ctx.trace.ops, "optimizer")
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
            f"{path}: {len(idx)} samples with non-finite values, batch positions {shown}"
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
    """A gradient exceeded its format's max in backward, after approaching it in earlier steps."""
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
            at = f" ({call.source_line or 'the call'} at {_short_source(call.source)})"
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


def _short_source(source: str) -> str:
    path, _, line = source.rpartition(":")
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    return f"{name}:{line}" if path else source


@rule(id="scale-collapse", kind="loss_scale", needs=("first_failure", "steps"))
def scale_collapse(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """GradScaler skipped step after step until the scale collapsed because unscaled gradients
    exceed the format (a backward op that makes NaN at every scale is backward-nan-op's)."""
    f = ctx.failure
    if f is None or f.phase != "loss_scaling":
        return
    if _collapse_cause(ctx) == "nan_op" and _backward_class(ctx).name == "nan_op":
        return  # backward-nan-op names the op; the collapse is its evidence
    streak = []
    for s in sorted(trace.steps, key=lambda s: s.index):
        if s.index < f.step:
            continue
        if not s.skipped:
            break
        streak.append(s)
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
        # the gradients grew past the format after updates were applied: exploding gradients,
        # named by the module whose own gradients are largest / grew most
        site = _grad_site(ctx) or (f.module, [])
        applied = [st for st in ctx.clean_steps() if _finite_pos(st.grad_norm)]
        if applied:
            evidence.append(
                "gradient norm of the applied steps before it "
                f"({_span([(st.index, 0.0) for st in applied[-6:]])}): "
                f"{_series([(st.index, st.grad_norm) for st in applied])}"
            )
        if site[1]:
            evidence.append(f"{site[0]}'s largest unscaled parameter gradient by step "
                            f"({_span(site[1])}): {_series(site[1])}")
        yield _finding(
            "error",
            f"exploding gradients in {site[0] or 'the model'}: after the applied updates the "
            f"gradients overflow {ctx.fmt.name} at every loss scale, so GradScaler skipped {n} "
            "steps in a row and the scale collapsed (the collapse is the symptom; clip the "
            "gradient norm)",
            evidence,
            kind="exploding_gradient",
            phase="backward",
            step=f.step,
            module=site[0] or None,
            tensor=f.tensor,
            rule="exploding-gradient",
            data={"skipped": n, "scale_from": first, "scale_to": last, "overflow": True,
                  "collapse": True, "spike": True,
                  "from_step": applied[0].index if applied else f.step},
        )
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
    trouble = []
    for i, e in enumerate(events):
        if e.event != "backoff" or e.step < after:
            continue
        if i > 0 and events[i - 1].event == "growth":
            continue  # a growth attempt that overflowed: how GradScaler probes
        trouble.append(e)
    tail = 0
    while tail < len(steps) and steps[-1 - tail].skipped:
        tail += 1
    evidence = []
    if trouble:
        shown = ", ".join(str(e.step) for e in trouble[:8])
        evidence.append(f"backoffs not preceded by a growth at steps {shown}")
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
            f"the loss scale backed off {len(trouble)} times after "
            "warm-up without a growth attempt to explain it",
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
    growth_steps = {e.step for e in trace.scaler_events if e.event == "growth"}
    # skips after calibration that no growth attempt explains
    later = [s for i, s in enumerate(steps[calib:], calib)
             if s.skipped and not (i > 0 and steps[i - 1].index in growth_steps)]
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
        harm.append(f"{len(later)} skips after the scale calibrated, not explained by a "
                    "growth attempt")
    if calib == len(steps) and calib >= 5:
        harm.append(f"every one of the {calib} steps was skipped: no update was applied (the "
                    f"scale fell from {steps[0].scale:g} to {steps[-1].scale:g} and the gradients "
                    "still overflowed)")
    elif share >= SKIP_SHARE and len(skipped) >= 5 and len(skipped) - calib >= 2:
        # (calibration alone is normal however short the run: skips must go on after it)
        harm.append(f"{_pct(share)} of the run's steps were skipped, "
                    f"{len(skipped) - calib} of them after the scale calibrated")
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


@rule(id="loss-spike", kind="lr_too_high", needs=("loss",))
def loss_spike(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """A finite loss far above the median of the steps before it."""
    th = ctx.th
    losses = [
        (s.index, s.loss) for s in ctx.clean_steps() if s.loss is not None and math.isfinite(s.loss)
    ]
    worst = None
    for i in range(3, len(losses)):
        prev = [v for _, v in losses[max(0, i - th.window) : i]]
        med = statistics.median(prev)
        ratio = losses[i][1] / med if med > 0 else 0.0
        if ratio >= th.loss_spike and (worst is None or ratio > worst[2]):
            worst = (losses[i][0], losses[i][1], ratio, med, len(prev))
    if worst is None:
        return
    step, value, ratio, med, n = worst
    evidence = [f"loss {_n(value)} at step {step}; median of the {n} steps before {_n(med)}"]
    rec = ctx.steps.get(step)
    if rec is not None and _finite_pos(rec.grad_norm):
        evidence.append(f"gradient norm at step {step}: {_n(rec.grad_norm)}")
    yield _finding(
        "warning",
        f"the loss spiked to {ratio:.3g}x its recent median at step {step}",
        evidence,
        step=step,
        score=min(8.0, 4.0 + math.log10(ratio)),
        data={"ratio": ratio},
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


# ----------------------------------------------------------------------------- diagnose


def _untraced_failure(ctx: Context) -> bool:
    """The failing step was one --sample-every did not trace: only its loss and gradient norm
    were checked, so the first non-finite value seen there is not its origin."""
    f = ctx.failure
    if f is None or f.phase == "data":
        return False
    rec = ctx.steps.get(f.step)
    if rec is None or rec.traced is None or rec.traced:
        return False
    # the cheap check sees the updated parameters and the gradient norm: weights that went
    # non-finite in an update of finite gradients were observed where they were made
    return not (f.phase == "optimizer" and rec.grad_norm is not None
                and math.isfinite(rec.grad_norm))


def _diagnose_untraced(trace: Trace, ctx: Context) -> None:
    f = ctx.failure
    assert f is not None
    traced = [s.index for s in trace.steps if s.traced]
    after = [i for i in traced if i > f.step]
    evidence = [f"steps traced in full: {', '.join(str(i) for i in traced[-8:]) or 'none'}"]
    if after:
        evidence.append(f"nanhunt traced the {len(after)} steps after it in full and the failure "
                        "did not recur there")
    trace.diagnosis = Finding(
        rule="untraced-step",
        kind="",
        severity="error",
        message=(
            f"step {f.step} went non-finite ({_where(f)}: {_counts(f.stats)}), but it was not "
            "traced (--sample-every): its origin was not observed, so no cause is named. Run "
            f"again without --sample-every (or with --max-steps {f.step + 1}) to trace step "
            f"{f.step}"
        ),
        evidence=evidence,
        step=f.step,
        score=ERROR_SCORE,
        data={"observed": False},
    )
    trace.warnings = []
    trace.notes.append(f"step {f.step} was not traced: the diagnosis names no cause")


def diagnose(trace: Trace, *, strict: bool = False, thresholds: Thresholds | None = None) -> None:
    """Fill ``trace.diagnosis`` and ``trace.warnings`` from :data:`RULES`.

    The diagnosis is the error that explains ``trace.first_failure``, picked by
    :data:`PRECEDENCE`; errors that lose become warnings. Warnings are ranked by score (worst
    first) and capped at ``thresholds.max_warnings``. A rule that raises on a malformed trace
    leaves a line in ``trace.notes`` and the others still run; with ``strict`` the exception
    propagates.
    ``trace.recommendations`` is left to :func:`nanhunt.advise.advise`.
    """
    ctx = Context(trace, thresholds)
    if _untraced_failure(ctx):
        _diagnose_untraced(trace, ctx)
        return
    errors: list[Finding] = []
    warnings: list[Finding] = []
    for r in RULES:
        if not r.applicable(trace):
            continue
        try:
            found = list(r.check(trace, ctx))
        except Exception as exc:
            if strict:
                raise
            trace.notes.append(f"rule {r.id} could not run: {type(exc).__name__}: {exc}")
            continue
        for finding in found:
            finding.rule = finding.rule or r.id
            finding.kind = finding.kind or r.kind
            (errors if finding.severity == "error" else warnings).append(finding)
    primary = None
    # a misused GradScaler is a bug whether or not the run has failed yet
    if errors and (trace.first_failure is not None
                   or any(e.rule in ALWAYS_PRIMARY for e in errors)):
        rank = {rid: i for i, rid in enumerate(PRECEDENCE)}
        errors.sort(key=lambda e: rank.get(e.rule, len(rank)))
        primary = errors.pop(0)
        primary.score = ERROR_SCORE
        explained = SUPERSEDES.get(primary.rule, ())
        errors = [e for e in errors if e.rule not in explained]
    for e in errors:
        e.severity = "warning"
        e.score = max(e.score, DEMOTED_SCORE) if primary is None else DEMOTED_SCORE
        warnings.append(e)
    warnings.sort(key=lambda w: -w.score)
    trace.diagnosis = primary
    trace.warnings = warnings[: ctx.th.max_warnings]


# rules for the training loop, crashes, vanished eps and unnormalised input live beside this
# module; importing it registers them (at the end: it imports the helpers above)
from . import causes as _causes  # noqa: E402
