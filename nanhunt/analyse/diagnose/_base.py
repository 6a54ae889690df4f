"""The shared parts of diagnosis: kinds, precedence, thresholds, the per-trace context
and the rule registry. Torch-free."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard

from nanhunt.errors import NanhuntError
from nanhunt.formats import FORMATS, NumberFormat, get_format
from nanhunt.trace import Failure, Finding, LayerStats, StepRecord, TensorStats, Trace

KINDS = (
    "overflow",
    "underflow",
    "nan_op",
    "bad_input",
    "exploding_gradient",
    "lr_too_high",
    "loss_scale",
    "logit_growth",
    "stall",
)

#: Which error explains the first failure when several rules fire, first match wins. Root causes
#: upstream of an overflow (weights or gradients growing step over step) outrank the overflow
#: they lead to; an invalid op (log(0)) is not explained by growth, so nan_op rules come first.
PRECEDENCE = (
    "scaler-crash",
    "range-constant",
    "scaler-misuse",
    "bad-input",
    "reduction-overflow",  # the reduction across ranks made it: before what it feeds
    "recompute-diverged",  # checkpointing's recomputation, not the forward, made it
    "optimizer-eps",
    "optimizer-update",
    "update-jump",  # weights the step before replaced: what any forward made of them follows
    "scale-collapse",
    "norm-eps",
    "input-range",  # a first layer on raw input: what it makes of it (inf, NaN) follows
    "loss-nan-op",
    "forward-nan-op",
    "backward-nan-op",
    "norm-underflow",
    "weight-growth",
    "exploding-gradient",
    # failures without a NaN (curves.py): errors only while every value is finite, explained by
    # the signal that moved first; after the growth rules, whose findings (Adam's steps of lr,
    # gradients exploding through time in a recurrence) name a cause more precisely; a post-LN
    # transformer without warm-up names the architecture the others' symptoms come from
    "post-ln-warmup",
    "loss-stall",
    "logit-growth",
    "loss-divergence",
    "loss-spike",
    "loss-plateau",
    "forward-overflow",
    "backward-overflow",
    "skip-streak",  # skips are often a symptom: an explosion or an op above explains them
)

#: Rules whose errors are the diagnosis even when no value went non-finite.
ALWAYS_PRIMARY = ("scaler-crash", "range-constant", "scaler-misuse", "exploding-gradient",
                  "skip-streak", "weight-growth", "logit-growth", "loss-divergence", "loss-spike",
                  "loss-stall", "loss-plateau", "post-ln-warmup")

#: Errors a primary diagnosis explains: they are its consequences, not warnings of their own
#: (a misused GradScaler makes updates that look like a learning rate too high).
SUPERSEDES: dict[str, tuple[str, ...]] = {
    "scaler-misuse": ("optimizer-update", "optimizer-eps", "weight-growth", "backward-overflow"),
    "optimizer-eps": ("optimizer-update",),
    "input-range": ("forward-overflow", "forward-nan-op"),
    "range-constant": ("forward-nan-op", "forward-overflow"),
    "norm-eps": ("forward-nan-op", "backward-nan-op", "norm-underflow"),
    "update-jump": ("forward-overflow", "forward-nan-op", "backward-overflow", "backward-nan-op",
                    "loss-nan-op", "weight-growth", "exploding-gradient", "norm-underflow",
                    "input-range"),
    "recompute-diverged": ("backward-nan-op", "backward-overflow", "scale-collapse"),
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
