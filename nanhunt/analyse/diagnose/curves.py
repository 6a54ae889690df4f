"""Failures without a NaN, read from the loss curve and explained by the signals: a loss spike
that does not recover, a loss that diverges (stays above its early value), a stall (updates that
round away, or a loss gone flat). Torch-free, like every rule.

The explanation is measured, not matched: every per-step series the trace holds (each module's
largest output, the largest attention logit a softmax saw inside it, the largest gradient of its
parameters; each param group's update-to-weight ratio) is read against its own first steps, and
the series that left its range first, before the loss did, is named with its numbers. docs/rules.md
defines the kinds (``logit_growth`` among them).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

from nanhunt.analyse.diagnose._base import Context, _finding, _n, is_norm_type, rule
from nanhunt.trace import Finding, GroupSignal, Trace

#: losses before a step whose noise it is judged against; the baseline is the median of the
#: last SPIKE_MIN of them (and a spike needs that many before it)
SPIKE_WINDOW = 16
SPIKE_MIN = 3
#: steps after a spike within which the loss must come back
RECOVER_WINDOW = 10
#: a spike: this many times the baseline and this many spreads above it
SPIKE_RATIO = 2.0
SPIKE_Z = 6.0
#: divergence: above this many times the early loss for the last DIVERGE_STEPS steps or more
DIVERGE_RATIO = 1.5
DIVERGE_STEPS = 5
#: a loss this many times its early value for DIVERGE_STEPS steps diverged, whatever spiked before
DIVERGE_FAR = 10.0
#: a series "moved" once it is this many times its value at its first recorded step
MOVED = 4.0
#: an update that changes the weights' norm by more than this in one step is out of proportion;
#: Karpathy's rule of thumb for a healthy run is about 1e-3
UPDATE_RATIO_HIGH = 0.1
UPDATE_RATIO_TARGET = 1e-3
#: an update at least this share of the weights' norm after it replaced the weights rather than
#: nudged them (healthy steps change them by about UPDATE_RATIO_TARGET)
UPDATE_JUMP = 0.5
#: ... and grew their norm this much in one step, to this much the largest norm of any group
JUMP_GROWTH = 10.0
#: ... and it is one of the last this many applied steps before the failure (a group whose small
#: initial weights a healthy first update outgrew, long before an unrelated failure, is no cause)
JUMP_LOOKBACK = 3
#: a stall: the update left this share of a low-precision group's elements unchanged
UNCHANGED = 0.5
#: logits this large make a softmax one-hot (e^-100) and its gradient vanish; Wortsman et al.
#: (2023) see healthy max attention logits in the tens and unstable ones at 1e3-1e4
LOGIT_LIMIT = 100.0
LOGIT_GROWTH = 10.0
#: z-loss coefficient advised for output-logit growth (PaLM, Wortsman et al. 2023)
Z_LOSS = 1e-4


def losses(trace: Trace) -> list[tuple[int, float]]:
    """Finite losses by step."""
    return [(s.index, s.loss) for s in sorted(trace.steps, key=lambda s: s.index)
            if s.loss is not None and math.isfinite(s.loss)]


@dataclass
class Spike:
    step: int  # the peak
    loss: float
    median: float  # the baseline: the median of the SPIKE_MIN losses before it
    score: float  # spreads above the median
    band: float  # the largest loss of the window before it: "recovered" is back at or below it
    recovered: int | None = None  # the step it came back at
    observed: int = 0  # steps recorded after the peak


def spike_scores(points: list[tuple[int, float]]) -> list[tuple[int, float, float]]:
    """(step, loss / baseline, spreads above the baseline) for each step after the first
    SPIKE_MIN: the baseline is the median of the SPIKE_MIN losses before it (it follows a falling
    curve), the spread the loss's step-to-step noise over the SPIKE_WINDOW before it (1.4826 x
    the median absolute change / sqrt 2, blind to the trend), at least 5% of the baseline."""
    out = []
    values = [v for _, v in points]
    for i in range(SPIKE_MIN, len(points)):
        base = statistics.median(values[i - SPIKE_MIN:i])
        window = values[max(0, i - SPIKE_WINDOW):i]
        steps = [abs(b - a) for a, b in itertools.pairwise(window)]
        noise = 1.4826 * statistics.median(steps) / math.sqrt(2) if steps else 0.0
        spread = max(noise, 0.05 * abs(base), 1e-12)
        out.append((points[i][0], values[i] / base if base > 0 else math.inf,
                    (values[i] - base) / spread))
    return out


def spikes(points: list[tuple[int, float]]) -> list[Spike]:
    """Loss spikes (consecutive spiking steps are one spike, at its peak) and whether each came
    back within RECOVER_WINDOW steps to the range of the SPIKE_WINDOW steps before it."""
    found: list[Spike] = []
    index = {s: i for i, (s, _) in enumerate(points)}
    last = -2  # index of the last spiking step
    for step, ratio, z in spike_scores(points):
        if ratio < SPIKE_RATIO or z < SPIKE_Z:
            continue
        i = index[step]
        if found and last == i - 1:  # the same spike
            last = i
            if points[i][1] > found[-1].loss:
                found[-1].step, found[-1].loss = step, points[i][1]
            continue
        last = i
        prev = [v for _, v in points[max(0, i - SPIKE_WINDOW):i]]
        base = statistics.median(prev[-SPIKE_MIN:])
        found.append(Spike(step, points[i][1], base, z, max(prev)))
    for sp in found:
        after = points[index[sp.step] + 1:]
        sp.observed = len(after)
        sp.recovered = next((s for s, v in after[:RECOVER_WINDOW] if v <= sp.band), None)
    return found


@dataclass
class Divergence:
    onset: int  # the first step of the final run above the early loss
    early: float  # the median of the first three losses, or the first where it is lower
    last: float
    peak: tuple[int, float]
    steps: int  # steps above
    band: float = 0.0  # the level the final run stayed above


def divergence(points: list[tuple[int, float]]) -> Divergence | None:
    """The loss above DIVERGE_RATIO x its early value (the median of its first three, or the
    first loss, the one no update changed, where that is lower) and above
    every loss before it (or, whatever came before, above DIVERGE_FAR x the early value), for the
    last DIVERGE_STEPS steps or more, up to the last one recorded: the curve left the range it
    had and stayed out. The range before is the noise floor: a noisy curve (small random batches)
    whose early losses happen to be small does not diverge by coming back to its usual level;
    an early spike above the plateau a run then diverges to does not hide the divergence. A run
    that starts within the first three steps must stay above DIVERGE_FAR x the early value."""
    if len(points) < 3 + DIVERGE_STEPS:
        return None
    values = [v for _, v in points]
    early = statistics.median(values[:3])
    if values[0] > 0:
        # the first loss is the one no update touched: a run that left at the first step
        # must not have its early value taken from losses that already diverged
        early = min(early, values[0])
    if early <= 0:
        return None
    best = None  # the longest final run above the range before it
    low = math.inf  # the smallest loss of the final run from k on
    for k in range(len(values) - 1, 0, -1):
        low = min(low, values[k])
        if k < 3:  # too few losses before to know their noise: only a far departure counts
            band = DIVERGE_FAR * early
        else:
            band = max(DIVERGE_RATIO * early, min(max(values[:k]), DIVERGE_FAR * early))
        if low > band:
            best = (k, band)
    if best is None or len(values) - best[0] < DIVERGE_STEPS:
        return None
    k, band = best
    tail = points[k:]
    return Divergence(tail[0][0], early, points[-1][1], max(tail, key=lambda p: p[1]),
                      len(tail), band)


# ----------------------------------------------------------------------------- the signals


@dataclass
class Mover:
    """A per-step series that left its range: what it measures, where, and by how much."""

    what: str  # "the largest attention logit in", "the largest output of", ...
    module: str | None
    signal: str  # attention_logit | output | param_grad | update_ratio
    first: tuple[int, float]  # its first recorded value
    moved: tuple[int, float]  # the first value MOVED x the first
    peak: tuple[int, float]  # its largest value up to the event

    @property
    def growth(self) -> float:
        return self.peak[1] / self.first[1] if self.first[1] > 0 else math.inf

    def describe(self, event: str) -> str:
        who = f"{self.what} {self.module}" if self.module else self.what
        return (f"{who} grew from {_n(self.first[1])} (step {self.first[0]}) to "
                f"{_n(self.peak[1])} (step {self.peak[0]}); it passed {MOVED:g}x its first value "
                f"at step {self.moved[0]}, {event}")


def _series(by_step: dict[int, float], until: int) -> list[tuple[int, float]]:
    return [(s, v) for s, v in sorted(by_step.items())
            if s <= until and v is not None and math.isfinite(v) and v > 0]


def _mover(points: list[tuple[int, float]], what: str, module: str | None,
           signal: str) -> Mover | None:
    if len(points) < 2:
        return None
    first = points[0]
    moved = next((p for p in points[1:] if p[1] >= MOVED * first[1]), None)
    if moved is None:
        return None
    return Mover(what, module, signal, first, moved, max(points, key=lambda p: p[1]))


def _output_module(ctx: Context) -> str | None:
    """The module that makes the model's output logits: the last module to run that has
    parameters of its own and is not a normalisation (an ``lm_head``, a classifier ``head``)."""
    heads = [lay for lay in ctx.trace.layers if lay.params and lay.forward_amax_by_step
             and not is_norm_type(lay.type)]
    if not heads:
        return None
    last = max(heads, key=lambda lay: ctx.order.get(lay.module, -1))
    # a module finishes after its children (layers are in the order their calls returned): a
    # root with weights of its own whose output is its head's yields to the head, which
    # returned first with the same values
    same = [lay for lay in heads if lay.forward_amax_by_step == last.forward_amax_by_step]
    return min(same, key=lambda lay: ctx.order.get(lay.module, -1)).module


def movers(ctx: Context, until: int) -> list[Mover]:
    """Every per-module series that moved (MOVED x its first value) by step ``until``, earliest
    first, the most grown first among those of one step. A container whose output is a child's
    (a Sequential's last layer, a model's head) moved because the child did: only the child (the
    one whose call returned first with the same values)."""
    found: list[Mover] = []
    head = _output_module(ctx)
    for layer in ctx.trace.layers:
        logits = _mover(_series(layer.logit_amax_by_step, until),
                        "the largest attention logit (softmax input) in", layer.module,
                        "attention_logit")
        output = _mover(_series(layer.forward_amax_by_step, until),
                        "the largest output logit of" if layer.module == head else
                        "the largest output of", layer.module,
                        "output_logit" if layer.module == head else "output")
        grads = {s: v / ctx.scale_at(s) for s, v in layer.param_grad_amax_by_step.items()}
        grad = _mover(_series(grads, until), "the largest parameter gradient of", layer.module,
                      "param_grad")
        found += [m for m in (logits, output, grad) if m is not None]
    order = ctx.order  # the order calls returned: a child before the container returning it

    kept = [m for m in found if not (m.signal == "output" and any(
        o is not m and o.signal in ("output", "output_logit") and o.first == m.first
        and o.peak == m.peak and order.get(o.module or "", -1) < order.get(m.module or "", -1)
        for o in found))]
    return sorted(kept, key=lambda m: (m.moved[0], -math.log(max(m.growth, 1.0))))


def breadth(ctx: Context, ms: list[Mover], step: int) -> tuple[int, int]:
    """(modules with parameters of their own whose output moved by ``step``, how many such
    modules have a recorded output): an lr far too high moves most of them at once."""
    leaves = {lay.module for lay in ctx.trace.layers if lay.params and lay.forward_amax_by_step}
    moved = {m.module for m in ms if m.signal in ("output", "output_logit")
             and m.module in leaves and m.moved[0] <= step}
    return len(moved), len(leaves)


def group_ratios(trace: Trace, until: int) -> dict[str, list[tuple[int, float]]]:
    """Each param group's update-to-weight ratio by applied step, up to ``until``."""
    out: dict[str, list[tuple[int, float]]] = {}
    for st in sorted(trace.signals, key=lambda s: s.step):
        if st.step > until:
            continue
        for g in st.groups:
            r = g.update_ratio
            if r is not None and math.isfinite(r):
                out.setdefault(g.group, []).append((st.step, r))
    return out


def _group_lr(trace: Trace, group: str) -> float | None:
    for st in sorted(trace.signals, key=lambda s: s.step):
        for g in st.groups:
            if g.group == group and g.lr:
                return g.lr
    return None


# ----------------------------------------------------------------------------- explanation


@dataclass
class Explanation:
    kind: str
    module: str | None
    evidence: list[str]
    mover: Mover | None
    group: str | None = None
    ratio: float | None = None  # the group's median update ratio before the event
    lr: float | None = None


def explain(trace: Trace, ctx: Context, event_step: int, event: str) -> Explanation:
    """Which series moved first before ``event_step`` and by how much, which param group's
    updates were out of proportion to its weights; the kind that follows from them: most
    modules moving at once after the first updates is the learning rate (``lr_too_high``);
    attention or output logits moving first, ``logit_growth``; a parameter gradient moving
    first, ``exploding_gradient``."""
    evidence: list[str] = []
    ms = movers(ctx, event_step)
    first = ms[0] if ms else None
    ratios = group_ratios(trace, event_step)
    group = ratio = None
    if ratios:
        meds = {g: statistics.median(v for _, v in pts) for g, pts in ratios.items()}
        group = max(meds, key=lambda g: meds[g])
        ratio = meds[group]
    kind, module = "lr_too_high", None
    if first is not None:
        moved, leaves = breadth(ctx, ms, first.moved[0])
        logit = next((m for m in ms if m.moved[0] == first.moved[0]
                      and m.signal in ("attention_logit", "output_logit")), None)
        if leaves >= 3 and moved * 2 >= leaves:
            evidence.append(f"the outputs of {moved} of the {leaves} modules with weights grew "
                            f"{MOVED:g}x or more by step {first.moved[0]}: the updates moved the "
                            "whole model at once")
            evidence.append(first.describe(event))
        else:
            lead = logit or first
            kind = {"attention_logit": "logit_growth", "output_logit": "logit_growth",
                    "param_grad": "exploding_gradient"}.get(lead.signal, "lr_too_high")
            module = lead.module
            first = lead
            evidence.append(lead.describe(event))
        for m in [m for m in ms if m is not first and m.moved[0] == first.moved[0]][:3]:
            evidence.append(f"at the same step: {m.what} {m.module} ({_n(m.first[1])} -> "
                            f"{_n(m.peak[1])})")
    elif trace.layers and not any(lay.forward_amax_by_step for lay in trace.layers):
        evidence.append("no per-module series was recorded (the sentinel measures only the "
                        "loss and the param groups): run with --mode full to name the module")
    if group is not None and ratio is not None:
        others = ", ".join(f"{g}: {meds[g]:.2g}" for g in meds if g != group)
        pts = ratios[group]
        evidence.append(
            f"param group {group}: each update changed its weights by {ratio:.2g} of their norm "
            f"(median over steps {pts[0][0]}-{pts[-1][0]}; about {UPDATE_RATIO_TARGET:g} is "
            "healthy)" + (f"; the other groups: {others}" if others else ""))
    lr = _group_lr(trace, group) if group else None
    return Explanation(kind, module, evidence, first, group, ratio, lr)


def _finding_for(ctx: Context, ex: Explanation, message: str, evidence: list[str], step: int,
                 data: dict) -> Finding:
    mech = {
        "logit_growth": (f"; {ex.mover.what} {ex.mover.module} grew first"
                         if ex.mover else ""),
        "exploding_gradient": (f"; the gradients of {ex.module} grew first" if ex.module else ""),
        "lr_too_high": (f"; updates of {ex.ratio:.2g} of the weights' norm a step in "
                        f"{ex.group}: the learning rate is too high" if ex.ratio is not None
                        and ex.ratio >= UPDATE_RATIO_HIGH else ""),
    }.get(ex.kind, "")
    data = {**data, "signal": ex.mover.signal if ex.mover else None,
            "group": ex.group, "update_ratio": ex.ratio, "lr": ex.lr}
    if ex.mover is not None:
        data.update({"moved_step": ex.mover.moved[0], "from": ex.mover.first[1],
                     "to": ex.mover.peak[1]})
    return _finding("error", message + mech, evidence + ex.evidence, kind=ex.kind,
                    phase="optimizer" if ex.kind == "lr_too_high" else "forward"
                    if ex.kind == "logit_growth" else "backward",
                    step=step, module=ex.module, score=6.0, data=data)


# ----------------------------------------------------------------------------- the rules


def _jump(trace: Trace, before: int) -> tuple[int, GroupSignal, float, float | None] | None:
    """The first of the last JUMP_LOOKBACK applied optimizer steps before ``before`` whose
    update replaced some group's weights, where no later step brought them back within
    JUMP_GROWTH x of their norm before it (the failure computed with the weights it wrote):
    (step, the group's signals, the update ratio, the weights' norm before).

    Replaced: the update is at least UPDATE_JUMP of the weights' norm after it, and that norm
    grew JUMP_GROWTH x from the weights' norm before the step, to JUMP_GROWTH x the largest
    weight norm any group had before it (a group of tiny weights, a LayerScale's 1e-5, that a
    healthy first update outgrew is no jump; nor is a zero-initialised one) - from gradients no
    larger than JUMP_GROWTH x those weights (a gradient that dwarfs the weights exploded: that
    is the gradient's doing, which clipping answers, not the learning rate's)."""
    steps = sorted((st for st in trace.signals if st.step < before), key=lambda st: st.step)
    for i, st in enumerate(steps):
        if i < len(steps) - JUMP_LOOKBACK:
            continue
        prior = {g.group: g.weight_norm for g in steps[i - 1].groups} if i else {}
        largest = max((_before(g, prior) or 0.0 for g in st.groups), default=0.0)
        for g in st.groups:
            r = g.update_ratio
            if r is None or not math.isfinite(r) or r < UPDATE_JUMP:
                continue
            was = _before(g, prior)
            if was is None and st.step == 0 and before == 1 and i == len(steps) - 1:
                return st.step, g, r, None  # (an older report: the first step's ratio alone)
            if not (was and g.weight_norm and math.isfinite(g.weight_norm)
                    and g.weight_norm >= JUMP_GROWTH * max(was, largest)):
                continue
            if g.grad_norm is not None and math.isfinite(g.grad_norm) and \
                    g.grad_norm > JUMP_GROWTH * was:
                continue  # the gradient exploded, and the update followed it
            later = [h.weight_norm for s2 in steps[i + 1:] for h in s2.groups
                     if h.group == g.group and h.weight_norm is not None]
            if any(n < JUMP_GROWTH * was for n in later):
                continue  # brought back since: the failure did not compute with these
            return st.step, g, r, was
    return None


def _before(g: GroupSignal, prior: dict[str, float | None]) -> float | None:
    """A group's weight norm before a step: measured (``weight_norm_before``), else the norm
    the step before left (a report older than that signal)."""
    return g.weight_norm_before if g.weight_norm_before is not None else prior.get(g.group)


@rule(id="update-jump", kind="lr_too_high", needs=("first_failure",))
def update_jump(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """The optimizer step before the failure replaced weights by its update: the learning
    rate, not the format the failure overflowed."""
    f = ctx.failure
    if f is None or f.phase in ("data", "optimizer"):
        return
    found = _jump(trace, f.step)
    if found is None:
        return
    step, g, ratio, was = found
    grew = (f"from {_n(was)} to {_n(g.weight_norm)}" if was else f"to {_n(g.weight_norm)}")
    lr = f" at lr={g.lr:g}" if g.lr else ""
    evidence = [
        f"param group {g.group}, step {step}: the update's norm was {_n(g.update_norm)}, "
        f"{ratio:.2g} of the weights' norm after it (a healthy step changes them by about "
        f"{UPDATE_RATIO_TARGET:g}); their norm went {grew}",
        f"the failure at step {f.step} ({f.phase}, {f.module or 'outside any module'}) "
        "computed with those weights: every value made from them is out of scale, in any "
        "number format",
    ]
    yield _finding(
        "error",
        f"the optimizer step at step {step} replaced the weights of {g.group} by its "
        f"update{lr}: the learning rate is too high, and the failure at step {f.step} follows "
        "from the weights it wrote (no number format holds them)",
        evidence, kind="lr_too_high", phase="optimizer", step=step, module=None, score=9.0,
        data={"group": g.group, "update_ratio": ratio, "lr": g.lr, "failure_step": f.step,
              "update_norm": g.update_norm, "weights_before": was})


@dataclass
class LogitRise:
    signal: str  # attention_logit | output_logit
    module: str
    crossed: tuple[int, float]  # the first step at or above LOGIT_LIMIT
    first: tuple[int, float]
    peak: tuple[int, float]


def logit_rises(ctx: Context) -> list[LogitRise]:
    """Attention logits (softmax inputs inside a module) and output logits that grew LOGIT_GROWTH
    x from their first recorded step to LOGIT_LIMIT or more: the earliest crossing first, the
    largest at that step first among those of one step."""
    until = ctx.fail_step if ctx.fail_step is not None else math.inf
    head = _output_module(ctx)
    found = []
    for layer in ctx.trace.layers:
        series = [("attention_logit", layer.logit_amax_by_step)]
        if layer.module == head:
            series.append(("output_logit", layer.forward_amax_by_step))
        for signal, by_step in series:
            pts = [(s, v) for s, v in _series(by_step, until)]
            if len(pts) < 2:
                continue
            crossed = next((p for p in pts if p[1] >= LOGIT_LIMIT), None)
            if crossed is None or crossed[1] < LOGIT_GROWTH * pts[0][1]:
                continue
            found.append(LogitRise(signal, layer.module, crossed, pts[0],
                                   max(pts, key=lambda p: p[1])))
    return sorted(found, key=lambda r: (r.crossed[0], -r.crossed[1]))


@rule(id="logit-growth", kind="logit_growth", needs=("layers",))
def logit_growth(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """Attention logits (a softmax's input inside a module) or the output logits grew 10x or
    more to 100 or more while every value stayed finite: the softmax saturates to one-hot, its
    gradient vanishes, and the model learns less or its loss diverges (Wortsman et al. 2023)."""
    if ctx.failure is not None:
        return
    rises = logit_rises(ctx)
    if not rises:
        return
    r = rises[0]
    what = ("the largest attention logit (softmax input) in" if r.signal == "attention_logit"
            else "the largest output logit of")
    ex = explain(trace, ctx, r.crossed[0], f"reaching {_n(r.crossed[1])} at step {r.crossed[0]}")
    pts = losses(trace)
    evidence = [f"{what} {r.module}: {_n(r.first[1])} at step {r.first[0]}, {_n(r.crossed[1])} "
                f"at step {r.crossed[0]}, {_n(r.peak[1])} at step {r.peak[0]} (a softmax over "
                f"logits {LOGIT_LIMIT:g} apart is one-hot: e^-{LOGIT_LIMIT:g})"]
    for o in rises[1:4]:
        where = "attention logits in" if o.signal == "attention_logit" else "output logits of"
        evidence.append(f"also: {where} {o.module} reached {_n(o.crossed[1])} at step "
                        f"{o.crossed[0]}")
    if pts:
        evidence.append(f"loss: {_n(pts[0][1])} at step {pts[0][0]}, lowest "
                        f"{_n(min(v for _, v in pts))}, {_n(pts[-1][1])} at step {pts[-1][0]}")
    whole = ex.kind == "lr_too_high" and ex.module is None and ex.mover is not None
    data = {"signal": r.signal, "from": r.first[1], "to": r.peak[1], "crossed_step": r.crossed[0],
            "group": ex.group, "update_ratio": ex.ratio, "lr": ex.lr}
    yield _finding(
        # the whole model moving at once is the learning rate's (loss-divergence says so)
        "warning" if whole else "error",
        f"{what} {r.module} grew from {_n(r.first[1])} to {_n(r.peak[1])} "
        f"(step {r.first[0]} to {r.peak[0]}) without a NaN: the softmax saturates",
        evidence + [e for e in ex.evidence if not e.startswith(what)],
        phase="forward", step=r.crossed[0], module=r.module, score=6.0 if not whole else 5.0,
        data=data)


@rule(id="loss-divergence", kind="lr_too_high", needs=("loss",))
def loss_divergence(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """The loss stayed above 1.5x its early value (the median of its first three) and above
    every loss before (or above 10x the early value) for the last five steps or more, with every
    value finite: the run diverged without a NaN."""
    if ctx.failure is not None:
        return
    pts = losses(trace)
    d = divergence(pts)
    if d is None:
        return
    ex = explain(trace, ctx, d.onset, f"before the loss rose above {DIVERGE_RATIO:g}x its early "
                 f"value at step {d.onset}")
    evidence = [f"loss: {_n(d.early)} early, {_n(d.peak[1])} at step {d.peak[0]}, "
                f"{_n(d.last)} at the last step; above {DIVERGE_RATIO:g}x the early value for "
                f"the last {d.steps} steps (from step {d.onset})"]
    yield _finding_for(ctx, ex, f"the loss diverged without a NaN: {_n(d.early)} early, "
                       f"{_n(d.last)} at the end, above {DIVERGE_RATIO:g}x its early value since "
                       f"step {d.onset}", evidence, d.onset,
                       {"onset": d.onset, "early": d.early, "last": d.last})


@rule(id="loss-spike", kind="lr_too_high", needs=("loss",))
def loss_spike(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """The loss jumped to 2x the median of the steps before it and 6 spreads above it; an error
    when it had not come back to their range within ten steps, a warning when it did (or when
    the run ended first)."""
    if ctx.failure is not None:
        return
    pts = losses(trace)
    found = spikes(pts)
    if not found:
        return
    if divergence(pts) is not None:
        found = [sp for sp in found if sp.recovered is not None]  # the divergence explains it
    for sp in found:
        head = (f"the loss spiked to {_n(sp.loss)} at step {sp.step}, {sp.loss / sp.median:.3g}x "
                f"the median ({_n(sp.median)}) of the steps before it")
        evidence = [f"{sp.score:.3g} spreads above that median; the largest loss before it "
                    f"was {_n(sp.band)}"]
        if sp.recovered is not None:
            yield _finding("warning", f"{head}; it recovered by itself at step {sp.recovered}",
                           evidence, step=sp.step, score=2.0,
                           data={"recovered": sp.recovered, "ratio": sp.loss / sp.median})
        elif sp.observed < RECOVER_WINDOW:
            yield _finding("warning", f"{head}; the run ended {sp.observed} steps after it, "
                           "before nanhunt could see whether it recovers", evidence,
                           step=sp.step, score=4.0, data={"recovered": None})
        else:
            ex = explain(trace, ctx, sp.step, f"before the loss spiked at step {sp.step}")
            evidence.append(f"it had not come back to {_n(sp.band)} or below in the "
                            f"{RECOVER_WINDOW} steps after it")
            yield _finding_for(ctx, ex, f"{head} and did not recover", evidence, sp.step,
                               {"recovered": None, "ratio": sp.loss / sp.median})


@rule(id="loss-stall", kind="underflow", needs=("loss",))
def loss_stall(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """Updates that round away: in a param group of low-precision weights, the optimizer's
    update left most elements exactly unchanged at most applied steps, so the model learns less
    than the same run in float32 would."""
    if ctx.failure is not None:
        return
    by_group: dict[str, list[GroupSignal]] = {}
    for st in trace.signals:
        for g in st.groups:
            by_group.setdefault(g.group, []).append(g)
    infos = {g.name: g for g in trace.param_groups}
    worst = None
    for name, sigs in by_group.items():
        info = infos.get(name)
        low = info is not None and any(d in ("bfloat16", "float16") or d.startswith("float8")
                                       for d in info.dtypes)
        fracs = [g.unchanged for g in sigs if g.unchanged is not None]
        if not low or not fracs:
            continue
        stalled = [f for f in fracs if f >= UNCHANGED]
        if len(stalled) * 2 < len(fracs) or len(fracs) < 3:
            continue
        med = statistics.median(fracs)
        if worst is None or med > worst[1]:
            worst = (name, med, len(stalled), len(fracs), info)
    if worst is None:
        return
    name, med, n, total, info = worst
    pts = losses(trace)
    evidence = [f"param group {name} ({', '.join(info.dtypes)} weights, {info.elements} "
                f"elements): the update left a median {med:.0%} of them exactly unchanged; "
                f"{n} of {total} applied steps left more than {UNCHANGED:.0%}"]
    if pts:
        evidence.append(f"loss: {_n(pts[0][1])} at step {pts[0][0]}, {_n(pts[-1][1])} at step "
                        f"{pts[-1][0]}")
    ratios = group_ratios(trace, max((s.step for s in trace.signals), default=0)).get(name)
    if ratios:
        r = statistics.median(v for _, v in ratios)
        text = f"each applied update changed its weights by a median {r:.2g} of their norm"
        if "bfloat16" in info.dtypes:
            text += (": bfloat16 keeps 8 significant bits, so a change under 2^-9 of a weight "
                     "rounds to nothing")
        evidence.append(text)
    yield _finding(
        "error",
        f"updates round away: the optimizer's steps left {med:.0%} of {name}'s "
        f"{'/'.join(info.dtypes)} weights unchanged, so the run learns less than in float32",
        evidence, phase="optimizer", step=trace.signals[0].step if trace.signals else None,
        module=None, score=6.0,
        data={"group": name, "unchanged": med, "dtypes": info.dtypes})


def stall_against(trace: Trace, reference: list[tuple[int, float]], noise: float) -> Finding | None:
    """For a reference run (the float32 rung of the experiment ladder): the run's loss fell
    less than the reference's by more than ``noise`` (the control runs' spread, in loss units) at
    the last step both recorded. A finding of kind ``underflow``, severity error, or None."""
    mine = dict(losses(trace))
    common = sorted(set(mine) & {s for s, _ in reference})
    if not common:
        return None
    last = common[-1]
    ref = dict(reference)
    gap = mine[last] - ref[last]
    if gap <= noise:
        return None
    return _finding("error", f"the run learns less than its float32 reference: loss "
                    f"{_n(mine[last])} against {_n(ref[last])} at step {last} (a gap of "
                    f"{_n(gap)}, the controls' spread is {_n(noise)})",
                    [f"loss at step {common[0]}: {_n(mine[common[0]])} here, "
                     f"{_n(ref[common[0]])} in float32"], rule="loss-stall", kind="underflow",
                    step=last, score=6.0, data={"gap": gap, "noise": noise})


# ----------------------------------------------------------------------------- a stall by slope

#: steps of each window whose slope the stall rule reads
STALL_WINDOW = 8
#: the pace before the break: the window just before it fell at least this share of the
#: window before that (a steady pace, not a curve slowing into its floor)
STALL_STEADY = 0.5
#: flat: after the break the loss fell at most this share of the pace before it
STALL_FLAT = 0.25
#: the fall over the window before the break, in noise units (the step-to-step spread)
STALL_Z = 8.0
#: a stall at or below this share of the first loss is the loss reaching its floor
STALL_FLOOR = 0.05
#: the lr after the break at least this share of the lr before it (a schedule decaying it to
#: nothing flattens the loss by design)
STALL_LR = 0.5


def slope(points: list[tuple[int, float]]) -> float:
    """Theil-Sen: the median of the slopes between every pair of points (robust to a spike)."""
    pairs = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.combinations(points, 2)
             if b[0] != a[0]]
    return statistics.median(pairs) if pairs else 0.0


def noise(values: list[float]) -> float:
    """The step-to-step noise of a curve: 1.4826 x the median absolute change / sqrt 2 (blind to
    a trend)."""
    steps = [abs(b - a) for a, b in itertools.pairwise(values)]
    return 1.4826 * statistics.median(steps) / math.sqrt(2) if steps else 0.0


@dataclass
class Stall:
    onset: int  # the first step of the flat part
    pace: float  # the loss's slope (per step) over the window before it
    earlier: float  # the slope over the window before that
    flat: float  # the slope from the onset to the end
    level: float  # the median loss from the onset on
    predicted: float  # the loss the earlier pace predicted at step ``until``
    last: int  # the last step
    noise: float
    lr: tuple[float, float] | None = None  # median lr before and after the onset
    until: int = 0  # STALL_WINDOW steps after the onset (or the last step)


def stall(points: list[tuple[int, float]], lrs: dict[int, float] | None = None) -> Stall | None:
    """The loss stopped falling at a pace it had kept: over two windows of STALL_WINDOW steps it
    fell steadily (the later at least STALL_STEADY x as fast as the earlier, and by STALL_Z noise
    units or more), then from the onset to the last step it fell at most STALL_FLAT x that pace,
    above STALL_FLOOR x its first value, with the lr (where recorded) not cut below STALL_LR x
    its value before, and inside a band (1.4826 x the median absolute deviation from its
    median) STALL_Z x narrower than the window's fall. A curve slowing into its floor
    (exponential decay), a schedule that decays the lr, a spike or a restart fail one of these.
    The earliest onset."""
    w = STALL_WINDOW
    if len(points) < 3 * w:
        return None
    values = [v for _, v in points]
    sigma = max(noise(values), 1e-12)
    first = values[0]
    for k in range(2 * w, len(points) - w + 1):
        earlier, before, after = points[k - 2 * w:k - w], points[k - w:k], points[k:]
        s0, s1 = slope(earlier), slope(before)
        if s1 >= 0 or s0 >= 0 or s1 > STALL_STEADY * s0 or -s1 * w < STALL_Z * sigma:
            continue
        # flat just after the break, and to the end
        if slope(after[:w]) < STALL_FLAT * s1 or slope(after) < STALL_FLAT * s1:
            continue
        level = statistics.median(v for _, v in after)
        if first > 0 and level <= STALL_FLOOR * first:
            continue
        # flat means inside a band much narrower than the fall the pace predicted (a saw-tooth
        # of restarts swings as far as it falls)
        band = 1.4826 * statistics.median(abs(v - level) for _, v in after)
        if -s1 * w < STALL_Z * band:
            continue
        lr = None
        if lrs:
            lb = [lrs[s] for s, _ in before if lrs.get(s) is not None]
            la = [lrs[s] for s, _ in after if lrs.get(s) is not None]
            if lb and la:
                lr = (statistics.median(lb), statistics.median(la))
                if lr[1] < STALL_LR * lr[0]:
                    continue
        k = _break(points, k, s1)
        at, until = points[k - 1], points[min(k + w, len(points)) - 1]
        return Stall(points[k][0], s1, s0, slope(points[k:]), level,
                     at[1] + s1 * (until[0] - at[0]), points[-1][0], sigma, lr, until[0])
    return None


def _break(points: list[tuple[int, float]], k0: int, pace: float) -> int:
    """The onset near the first index ``k0`` that qualified: the index where a line of slope
    ``pace`` up to it and a constant after it fit the STALL_WINDOW steps on each side best (the
    first qualifying index can sit a few steps early: a window that is mostly flat already
    reads flat)."""
    w = STALL_WINDOW

    def cost(k: int) -> float:
        before, after = points[k - w:k], points[k:k + w]
        line = statistics.median(v - pace * s for s, v in before)
        flat = statistics.median(v for _, v in after)
        return sum(abs(v - line - pace * s) for s, v in before) + \
            sum(abs(v - flat) for _, v in after)

    return min(range(k0, min(k0 + w, len(points) - w) + 1), key=cost)


def _unchanged_after(trace: Trace, onset: int) -> tuple[str, float] | None:
    """The param group whose updates left the largest median share of its elements unchanged
    from ``onset`` on."""
    by: dict[str, list[float]] = {}
    for st in trace.signals:
        if st.step >= onset:
            for g in st.groups:
                if g.unchanged is not None:
                    by.setdefault(g.group, []).append(g.unchanged)
    if not by:
        return None
    name = max(by, key=lambda g: statistics.median(by[g]))
    return name, statistics.median(by[name])


@rule(id="loss-plateau", kind="stall", needs=("loss",))
def loss_plateau(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """The loss stopped falling at the pace it had kept: over two windows of eight steps it fell
    steadily, then from one step to the end it fell at most a quarter as fast, with the learning
    rate not cut by the schedule: the run's own earlier slope says it should still fall."""
    if ctx.failure is not None:
        return
    pts = losses(trace)
    lrs = {s.index: s.lr for s in trace.steps if s.lr is not None}
    st = stall(pts, lrs)
    if st is None:
        return
    ex = explain(trace, ctx, st.onset, f"before the loss stopped falling at step {st.onset}")
    evidence = [f"loss: fell {-st.earlier:.3g} then {-st.pace:.3g} a step over the "
                f"{2 * STALL_WINDOW} steps before step {st.onset} (its noise is {st.noise:.2g} a "
                f"step), then {-st.flat:.2g} a step to step {st.last}: it stayed about "
                f"{_n(st.level)}, where that pace would have reached {_n(st.predicted)} by step "
                f"{st.until}"]
    if st.lr is not None:
        evidence.append(f"the lr was {st.lr[0]:.3g} before and {st.lr[1]:.3g} after: the "
                        "schedule did not cut it")
    kind = ex.kind if ex.mover is not None and ex.module is not None else "stall"
    rounded = _unchanged_after(trace, st.onset)
    if kind == "stall" and rounded is not None and rounded[1] >= UNCHANGED:
        kind = "underflow"
        evidence.append(f"from step {st.onset} the updates left a median {rounded[1]:.0%} of "
                        f"{rounded[0]}'s elements exactly unchanged: they round away")
    ratios = group_ratios(trace, st.last)
    for group, pts_g in ratios.items():
        before = [v for s, v in pts_g if s < st.onset]
        after = [v for s, v in pts_g if s >= st.onset]
        if before and after:
            b, a = statistics.median(before), statistics.median(after)
            evidence.append(f"param group {group}: updates of {b:.2g} of the weights' norm a "
                            f"step before, {a:.2g} after")
    message = (f"the loss stopped falling at step {st.onset}: about {_n(st.level)} to step "
               f"{st.last}, where its earlier pace ({-st.pace:.3g} a step) would have reached "
               f"{_n(st.predicted)} by step {st.until}")
    if kind in ("stall", "underflow"):
        yield _finding("error", message, evidence + ex.evidence, kind=kind,
                       phase="optimizer", step=st.onset, score=6.0,
                       data={"onset": st.onset, "pace": st.pace, "flat": st.flat,
                             "level": st.level, "group": ex.group, "update_ratio": ex.ratio,
                             "lr": ex.lr})
        return
    ex.kind = kind
    yield _finding_for(ctx, ex, message, evidence, st.onset,
                       {"onset": st.onset, "pace": st.pace, "flat": st.flat, "level": st.level})


# ----------------------------------------------------------------------------- post-LN, no warm-up


def post_ln_blocks(trace: Trace) -> list[tuple[str, list[str]]]:
    """Blocks whose normalisation follows their sublayers (post-LN, Xiong et al. 2020): a module
    whose children with weights include an attention and two or more normalisations, the
    attention returning before the first of them and a normalisation returning last (in a
    pre-LN block the feed-forward returns last). (block, its children in the order they
    returned), from the order of the trace's layers (calls in the order they returned)."""
    layers = trace.layers
    order = {lay.module: i for i, lay in enumerate(layers)}
    weighted = {lay.module for lay in layers if lay.params}

    def has_weights(name: str) -> bool:
        return any(n == name or n.startswith(name + ".") for n in weighted)

    def attention(name: str) -> bool:
        return any((lay.module == name or lay.module.startswith(name + ".")) and
                   ("attention" in lay.type.lower() or lay.logit_amax_by_step)
                   for lay in layers)

    children: dict[str, list[str]] = {}
    for lay in layers:
        if "." in lay.module:
            children.setdefault(lay.module.rsplit(".", 1)[0], []).append(lay.module)
    by_name = {lay.module: lay for lay in layers}
    found = []
    for parent, kids in children.items():
        kids = sorted((k for k in kids if has_weights(k)), key=lambda k: order[k])
        norms = [k for k in kids if is_norm_type(by_name[k].type)]
        attn = [k for k in kids if attention(k) and k not in norms]
        if len(norms) >= 2 and attn and kids[-1] in norms and \
                order[attn[0]] < order[norms[0]]:
            found.append((parent, kids))
    return sorted(found, key=lambda b: order.get(b[0], 0))


def _first_lrs(trace: Trace) -> list[float]:
    """The lr of the first applied steps: the step records', else the first group's signal."""
    lrs = [s.lr for s in sorted(trace.steps, key=lambda s: s.index)
           if s.lr is not None and not s.skipped]
    if not lrs:
        lrs = [st.groups[0].lr for st in sorted(trace.signals, key=lambda s: s.step)
               if st.groups and st.groups[0].lr is not None]
    return [float(v) for v in lrs]


def no_warmup(trace: Trace) -> float | None:
    """The lr of the first step where the run trained at it from the start (no warm-up: the lr
    of its first steps does not rise to 10% above it); None where it warmed up or fewer than 3
    steps' lr were recorded."""
    lrs = _first_lrs(trace)
    if len(lrs) < 3:
        return None
    head = lrs[: max(3, min(10, len(lrs)))]
    return lrs[0] if lrs[0] >= 0.9 * max(head) else None


def _grad_by_block(trace: Trace, blocks: list[str]) -> list[tuple[str, float]]:
    """The largest parameter gradient (unscaled) inside each block at its first recorded step."""
    out = []
    for block in blocks:
        vals = []
        for lay in trace.layers:
            if lay.module.startswith(block + ".") and lay.param_grad_amax_by_step:
                step = min(lay.param_grad_amax_by_step)
                vals.append(lay.param_grad_amax_by_step[step])
        if vals:
            out.append((block, max(vals)))
    return out


@rule(id="post-ln-warmup", kind="lr_too_high", needs=("layers", "loss"))
def post_ln_warmup(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """A post-LN transformer (its blocks normalise after the residual add) trained at its full
    learning rate from the first step, whose loss did not fall below its first value (or
    diverged, spiked and stayed, or stopped falling): post-LN needs a warm-up (Xiong et al.
    2020), its gradients near the output are large at initialisation."""
    if ctx.failure is not None:
        return
    blocks = post_ln_blocks(trace)
    lrs = _first_lrs(trace)
    pts = losses(trace)
    if not blocks or len(pts) < 8 or no_warmup(trace) is None:
        return
    values = [v for _, v in pts]
    sigma = noise(values)
    tail = values[-max(3, len(values) // 4):]
    failed = []
    if statistics.median(tail) > values[0] - 2 * sigma:
        failed.append(f"the loss did not fall: {_n(values[0])} at step {pts[0][0]}, a median "
                      f"{_n(statistics.median(tail))} over its last {len(tail)} steps (noise "
                      f"{sigma:.2g} a step)")
    d = divergence(pts)
    if d is not None:
        failed.append(f"it diverged from step {d.onset}")
    if any(sp.recovered is None and sp.observed >= RECOVER_WINDOW for sp in spikes(pts)):
        failed.append("a loss spike did not recover")
    st = stall(pts, {s.index: s.lr for s in trace.steps if s.lr is not None})
    if st is not None:
        failed.append(f"the loss stopped falling at step {st.onset}")
    if not failed:
        return
    names = [b for b, _ in blocks]
    first, kids = blocks[0]
    short = [k.rsplit(".", 1)[-1] for k in kids]
    evidence = [f"{len(names)} post-LN block{'s' if len(names) > 1 else ''} ({', '.join(names[:4])}"
                + (", ..." if len(names) > 4 else "") + f"): in {first} the sublayers returned "
                f"in the order {', '.join(short)}; a normalisation runs after each sublayer "
                "(after the residual add), none before",
                f"the lr was {lrs[0]:.3g} from the first step: no warm-up",
                *failed]
    ratios = group_ratios(trace, pts[-1][0])
    for group, gp in ratios.items():
        early = [v for _, v in gp[:3]]
        if early:
            evidence.append(f"param group {group}: the first updates changed its weights by "
                            f"{max(early):.2g} of their norm (about {UPDATE_RATIO_TARGET:g} is "
                            "healthy; Adam's first steps are lr-sized for every weight)")
    grads = _grad_by_block(trace, names)
    if len(grads) >= 2 and grads[0][1] > 0:
        r = grads[-1][1] / grads[0][1]
        evidence.append(f"at the first step the largest parameter gradient in {grads[-1][0]} "
                        f"(nearest the output) was {r:.3g}x that in {grads[0][0]}"
                        + (": post-LN's gradients are largest near the output at "
                           "initialisation (Xiong et al. 2020), which a warm-up tempers"
                           if r > 1 else ""))
    ex = explain(trace, ctx, pts[-1][0], "during the run")
    evidence += [e for e in ex.evidence if not e.startswith("param group")]
    group, ratio = ex.group, ex.ratio
    yield _finding(
        "error", f"a post-LN transformer ({first} and its like) trained at lr {lrs[0]:.3g} from "
        f"the first step, without warm-up: {failed[0]}", evidence, phase="optimizer",
        step=pts[0][0], module=first, score=7.0,
        data={"blocks": names, "lr": lrs[0], "group": group, "update_ratio": ratio,
              "failed": failed})
