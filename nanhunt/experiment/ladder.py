"""Diagnosis by experiment: which re-runs to make, how to read each, what they prove. Torch-free.

Every experiment is the user's script run again to a horizon with one change installed from
outside (a ``--fix`` spec) or none (the control). :func:`first_rungs` and :func:`next_rungs`
plan them, :func:`outcome` reads one re-run's report against the original run, and
:func:`classify` turns the outcomes into a verdict (the decision table in docs/rules.md):

* the control does not fail at the original's step: the failure did not recur; nothing is
  verified;
* float32 everywhere trains: a precision failure; bfloat16 training too makes it a range
  failure (float16's exponent range), bfloat16 failing a resolution one; GradScaler disabled
  training (with a scaler in the loop) makes it loss scaling;
* float32 everywhere fails the same way (or the run used no low-precision format): not
  precision-specific; the learning-rate rungs or clipping at the measured gradient norm
  training make it optimisation, replacing the failing batch data; else code that fails in any
  precision.

Where float32 everywhere trains, :mod:`nanhunt.experiment.region` bisects float32 over the
module tree to the smallest region that removes the failure, and GradScaler's init_scale is
tried at the value the gradients' exponents call for (:func:`measured_init_scale`).

The rules then name the op, the mechanism and the fix inside the verdict; a rule whose cause
the experiments contradict loses (:func:`contradiction`), and the report says why.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanhunt.analyse.advise import choose_init_scale, clip_value
from nanhunt.analyse.curve_advice import warmup_steps
from nanhunt.analyse.diagnose.curves import no_warmup, post_ln_blocks
from nanhunt.fixspec import MAX_SAMPLES, number, parse_fix, sample_rows
from nanhunt.formats import get_format
from nanhunt.trace import Experiment, Experiments, Finding, StepRecord, Trace

__all__ = ["BLOWUP", "MIN_SILENT_STEPS", "Rung", "batch_rungs", "batch_runs", "batches_said",
           "classify", "contradiction", "cured_batch", "divergence_batch_rungs", "drop",
           "excuse_cycles", "failure_step", "first_rungs", "half_optimizer", "horizon", "learning",
           "lines_runs", "loss_gap", "loss_span", "measured_clip", "measured_growth_interval",
           "measured_init_scale", "next_rungs", "outcome", "rung_value", "same_problem",
           "samples_rung", "silent_candidate", "silent_verdict", "source_ranges", "source_rungs",
           "suspect_rungs", "uses_low_precision", "warmup_verdict"]

BLOWUP = 10.0  # a loss this many times its first value is not training
CALIBRATION_SKIPS = 4  # GradScaler's first skips while it finds its scale
HORIZON_FACTOR, HORIZON_MIN = 2, 20  # re-runs run to max(2 x failure, failure + 20)
#: the percentile of the gradient norms before the failure that the clip rung clips at
CLIP_PERCENTILE = 10.0
#: a run with no problem is compared with its float32 experiment when it ran this many steps
#: (fewer cannot show that it learns less)
MIN_SILENT_STEPS = 20


@dataclass(frozen=True)
class Rung:
    name: str
    fixes: tuple[str, ...]
    purpose: str


def failure_step(trace: Trace) -> int | None:
    """The step the experiments are read at: the first failure's, else the diagnosis's (a
    failure with no non-finite value), else the crash's."""
    if trace.first_failure is not None:
        return trace.first_failure.step
    if trace.diagnosis is not None and trace.diagnosis.step is not None:
        return trace.diagnosis.step
    if trace.crash is not None and getattr(trace.crash, "step", None) is not None:
        return trace.crash.step
    return None


def horizon(step: int | None, trace: Trace, max_steps: int | None) -> int:
    """Steps a re-run runs: past max(2 x the failure step, failure step + 20)."""
    last = max((s.index for s in trace.steps), default=0)
    at = step if step is not None else last
    n = max(HORIZON_FACTOR * at, at + HORIZON_MIN) + 1
    return min(n, max_steps) if max_steps else n


#: DDP communication hooks that all-reduce the gradients in a 16-bit format
_COMPRESSION_HOOKS = {"fp16_compress_hook": "float16", "bf16_compress_hook": "bfloat16"}


def _compressions(trace: Trace) -> set[str]:
    return {_COMPRESSION_HOOKS[h] for h in trace.run.comm_hooks if h in _COMPRESSION_HOOKS}


def uses_low_precision(trace: Trace) -> bool:
    run = trace.run
    return bool(run.autocast or run.scaler or
                any(d in ("float16", "bfloat16") for d in run.dtypes) or
                (run.target in ("float16", "bfloat16") and run.target_source != "default")
                or _compressions(trace))


def _float16(trace: Trace) -> bool:
    return "float16" in trace.run.dtypes or (trace.run.autocast and
                                             trace.run.target == "float16") \
        or "float16" in _compressions(trace)


def first_rungs(trace: Trace) -> list[Rung]:
    """The control, and float32 everywhere where the run used a low-precision format."""
    rungs = [Rung("control", (), "does the failure recur with nothing changed?")]
    if uses_low_precision(trace):
        rungs.append(Rung("fp32", ("fp32-all",), "does it recur in float32 everywhere?"))
    return rungs


def suspect_rungs(trace: Trace, steps: int | None = None) -> list[Rung]:
    """The experiments a run with no failure found calls for by its structure alone: a post-LN
    transformer (its blocks normalise after the residual add) trained at its full learning rate
    from the first step gets a linear warm-up (Xiong et al. 2020) over half the re-run
    (``steps``, the whole run by default), at most Adam's 2 / (1 - beta2) steps. Its re-run says
    whether the run learns measurably more with it (:func:`warmup_verdict`)."""
    if not trace.optimizers or no_warmup(trace) is None or not post_ln_blocks(trace):
        return []
    beta2 = next((o.beta2 for o in trace.optimizers if o.beta2 is not None and 0 < o.beta2 < 1),
                 None)
    k = max(2, min(warmup_steps(beta2) if beta2 is not None else warmup_steps(),
                   (steps or len(trace.steps)) // 2))  # half of what the re-run will run
    return [Rung("warmup", (f"warmup={k}",),
                 f"does a linear warm-up over {k} steps make this post-LN transformer learn "
                 "more?")]


def measured_clip(trace: Trace, step: int | None) -> float | None:
    """``max_norm`` measured from the run: the 10th percentile (nearest rank: the smallest of up
    to ten) of the finite gradient norms of the steps before ``step`` (all recorded steps when
    None), rounded up to 1, 2 or 5 times a power of ten. Gradients that explode grow for
    several steps before anything fails, so the median of those steps is already part of the
    growth; the low end is what the run's gradients were while it trained, and the rung asks
    whether holding them there removes the failure. None where no gradient norm was
    recorded."""
    norms = [s.grad_norm for s in trace.steps if s.grad_norm is not None and
             (step is None or s.index < step)]
    return clip_value([n for n in norms if n is not None], percentile=CLIP_PERCENTILE)


def measured_init_scale(trace: Trace) -> float | None:
    """GradScaler's init_scale from the unscaled gradients' exponent histogram
    (:func:`nanhunt.analyse.advise.choose_init_scale`: nothing overflows, a binade or two of
    headroom, the most mass normal). A step GradScaler skipped left its overflowing gradients out
    of the histogram (they were inf), so where the run skipped steps the choice is capped at the
    largest scale at which the run applied a step (its gradients' top exponent fitted float16
    there) below every scale at which it skipped one (batches differ: one that fitted at a scale
    another overflowed at is no guarantee), or below the smallest scale tried when it applied
    none. None where no gradient
    histogram was recorded, or where the run's own first scale is that value already."""
    fmt = get_format(trace.run.target)
    hist = dict(trace.grad_hist.get(fmt.name) or {})
    if not hist:
        for h in trace.grad_hist.values():
            for e, c in h.items():
                hist[e] = hist.get(e, 0) + c
    if not any(c > 0 for c in hist.values()):
        return None
    steps = sorted(trace.steps, key=lambda s: s.index)
    scales = [s.scale for s in steps if s.scale is not None and math.isfinite(s.scale) and
              s.scale > 0]
    current = scales[0] if scales else None
    k = choose_init_scale(hist, fmt, current).k
    if any(s.skipped for s in steps) and scales:
        # below every scale a step was skipped at: another batch overflowed where one fitted
        # (a step whose loss was already non-finite overflowed at any scale: it says nothing)
        skipped = min((s.scale for s in steps if s.skipped and s.scale is not None and
                       math.isfinite(s.scale) and s.scale > 0 and s.loss is not None and
                       math.isfinite(s.loss)), default=math.inf)
        applied = [s.scale for s in steps if not s.skipped and s.scale is not None and
                   math.isfinite(s.scale) and 0 < s.scale < skipped]
        k = min(k, math.floor(math.log2(max(applied))) if applied else
                math.floor(math.log2(min([*scales, skipped]))) - 1)
    if current is not None and k == round(math.log2(current)):
        return None
    return 2.0 ** k


def measured_growth_interval(trace: Trace, scale: float | None, step: int | None) -> int | None:
    """GradScaler's growth_interval that lets it climb by itself from the run's first scale to
    ``scale`` (:func:`measured_init_scale`, from the gradients' exponents) by half the failure
    step: the failure step over twice the doublings it needs. None where the measured scale is
    not above the run's (the scale was not too low), the failure comes too early for any
    interval (fewer than two steps a doubling), or the script's own interval is that short
    already."""
    scales = [s.scale for s in sorted(trace.steps, key=lambda s: s.index)
              if s.scale is not None and math.isfinite(s.scale) and s.scale > 0]
    if scale is None or step is None or not scales or scale <= scales[0]:
        return None
    k = math.ceil(math.log2(scale / scales[0]))
    if step < 2 * k:
        return None
    n = max(1, step // (2 * k))
    current = (trace.run.scaler_settings or {}).get("growth_interval")
    if current is not None and n >= current:
        return None
    return n


def half_optimizer(trace: Trace) -> bool:
    """Whether an optimizer stepped 16-bit parameters (its update and state in that format)."""
    return any(d in ("float16", "bfloat16") for o in trace.optimizers for d in o.param_dtypes)


_BLOCKS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.For, ast.AsyncFor, ast.While, ast.If,
           ast.With, ast.AsyncWith, ast.Try)


def source_ranges(path: str, line: int) -> list[tuple[int, int]]:
    """The lines a source rung keeps in float32, narrowest first: the statement holding
    ``line`` (all its lines), then the innermost block around it (a ``with``, a loop body, a
    function); one range where they are the same, ``line`` alone where the file cannot be
    parsed."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return [(line, line)]
    stmt = block = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        end = node.end_lineno or node.lineno
        if not node.lineno <= line <= end:
            continue
        if isinstance(node, _BLOCKS):
            if block is None or end - node.lineno < block[1] - block[0]:
                block = (node.lineno, end)
        elif stmt is None or end - node.lineno < stmt[1] - stmt[0]:
            stmt = (node.lineno, end)
    out = [stmt or (line, line)]
    if block is not None and block != out[0]:
        out.append(block)
    return out


def lines_spec(path: str, lines: tuple[int, int]) -> str:
    a, b = lines
    return f"fp32-lines:{path}:{a}" + (f"-{b}" if b != a else "")


def source_rungs(ex: Experiments) -> list[Rung]:
    """Where the control's op-by-op watch saw the first non-finite value made by an op written
    on a user's line (not inside a module): float32 for the ops on that statement, and on the
    block around it."""
    path, _, line = ex.source_line.rpartition(":")
    if not path or not line.isdigit():
        return []
    name = Path(path).name
    return [Rung("lines", (lines_spec(path, r),),
                 f"does float32 for the ops written on lines {r[0]}-{r[1]} of {name} (not "
                 "the modules they call) remove the failure?")
            for r in source_ranges(path, int(line))]


def next_rungs(trace: Trace, ex: Experiments) -> list[Rung]:
    """The rungs the first outcomes call for."""
    fp32 = _run(ex, "fp32")
    step = ex.failure_step
    rungs: list[Rung] = []
    precision = cured(fp32, ex)
    if precision:
        rungs += source_rungs(ex)
        if _float16(trace):
            rungs.append(Rung("bf16", ("bf16",), "does bfloat16 (float32's range, fewer "
                                                 "mantissa bits) train?"))
        if half_optimizer(trace):
            rungs.append(Rung("fp32-master", ("fp32-master",),
                              "does it train with float32 master weights and optimizer state "
                              "(the forward and backward unchanged)?"))
        if trace.run.scaler:
            rungs.append(Rung("no-scaler", ("no-scaler",),
                              "does it train without loss scaling?"))
            scale = measured_init_scale(trace)
            if scale is not None:
                k = math.log2(scale)
                rungs.append(Rung("init-scale", (f"init-scale={number(scale)}",),
                                  "does GradScaler train from the scale the gradients' "
                                  f"exponents call for (2^{k:g})?"))
                # the same scale reached by GradScaler itself, growing sooner: the growth
                # variant (where the run's scale started below it)
                every = measured_growth_interval(trace, scale, step)
                if every is not None:
                    rungs.append(Rung("growth-interval", (f"growth-interval={every}",),
                                      f"does GradScaler train when it grows every {every} "
                                      f"steps, reaching 2^{k:g} by itself before step "
                                      f"{step}?"))
        return rungs
    if trace.optimizers or any(s.lr is not None for s in trace.steps):
        rungs += [Rung("lr-0.1", ("lr-factor=0.1",), "does a 10x lower learning rate train?"),
                  Rung("lr-0.01", ("lr-factor=0.01",),
                       "does a 100x lower learning rate train?")]
        clip = measured_clip(trace, step)
        if clip is not None:
            rungs.append(Rung("clip", (f"clip={number(clip)}",),
                              f"does clipping the gradient norm at {number(clip)} (the low end "
                              "of the norms before the failure) train?"))
    rungs += batch_rungs(ex, step)
    sample = samples_rung(trace)
    if sample is not None:
        rungs.append(sample)
    return rungs


def batch_rungs(ex: Experiments, step: int | None) -> list[Rung]:
    """The batch rungs of a failure at ``step``: its batch replaced by the one before; and where
    the control's loss blew up (BLOWUP x its first) before that step, the batch of the step it
    blew up at and of the step before (a batch whose gradient wrecked the weights shows in the
    next step's loss), each likewise: the failure may be where a rule fired, long after the
    batch that started it."""
    control = _run(ex, "control")
    onset = _blowup_at(control) if control is not None else None
    steps = [step] if step is not None else []
    if onset is not None and (step is None or onset < step):
        steps += [onset, onset - 1]
    return [Rung("skip-batch", (f"skip-batch={s}",),
                 f"does it train with step {s}'s batch replaced by step {s - 1}'s?"
                 + (f" (the loss blew up at step {onset})" if s != step else ""))
            for s in dict.fromkeys(steps) if s >= 1]


def divergence_batch_rungs(ex: Experiments) -> list[Rung]:
    """For a run with no failure found whose control diverged again: the batch rungs of the step
    it diverged at (:func:`batch_rungs`). None where the control did not diverge."""
    control = _run(ex, "control")
    if control is None or control.outcome != "diverged":
        return []
    at = _diverged_at(control)
    return batch_rungs(ex, None) if _blowup_at(control) is not None else [
        Rung("skip-batch", (f"skip-batch={s}",),
             f"does it train with step {s}'s batch (the run diverged at step {at}) replaced by "
             f"step {s - 1}'s?") for s in (at, at - 1) if s >= 1]


def batch_runs(ex: Experiments) -> list[Experiment]:
    """The batch rungs whose re-runs trained or failed, by step."""
    # (a re-run that crashed or was stopped, a batch rung that replaced nothing among them,
    # showed nothing about its batch)
    return sorted((e for e in ex.runs if e.rung == "skip-batch" and e.fixes and
                   e.outcome in ("trained", "recurred", "moved", "diverged")),
                  key=lambda e: int(rung_value(e)))


def batches_said(runs: list[Experiment], check: Any, how: str) -> str:
    """What the batch rungs ``runs`` showed where none is the cause (:func:`cured_batch`):
    each removed it (``check``), or none did (``how``: their outcomes)."""
    batches = " or ".join(f"step {rung_value(e)}'s batch" for e in runs)
    if len(runs) > 1 and all(check(e) for e in runs):
        return f"replacing {batches} each removes it: the run is sensitive to its data, no " \
            "one batch is bad"
    return f"replacing {batches} does not ({how})"


def cured_batch(ex: Experiments, *, check: Any = None) -> Experiment | None:
    """The earliest batch rung that removed the failure (``check``: the test, :func:`cured` by
    default), where it is specific: with more than one batch rung run, one replaced batch that
    did not remove it (every replaced batch curing says the run is sensitive to its data, not
    that one batch is bad)."""
    runs = batch_runs(ex)
    ok = [e for e in runs if (check(e) if check is not None else cured(e, ex))]
    if not ok or (len(runs) > 1 and len(ok) == len(runs)):
        return None
    return ok[0]


def _blowup_at(e: Experiment) -> int | None:
    """The first step at which a re-run's loss was non-finite or above BLOWUP x its first."""
    first = next((v for v in e.losses if v is not None and math.isfinite(v)), None)
    for i, v in enumerate(e.losses):
        if v is not None and (not math.isfinite(v) or (
                first and abs(v) > BLOWUP * abs(first))):
            return i
    return None


def samples_rung(trace: Trace) -> Rung | None:
    """Where the failing batch's non-finite values were in some of its samples (rows), not all:
    does replacing those samples alone remove the failure? (The batch rung replaces all of it.)
    None without named samples, or where every row was bad."""
    f = trace.first_failure
    if f is None or not f.bad_samples or not f.batch_rows:
        return None
    rows = sorted({i for idx in f.bad_samples.values() for i in idx})
    if not rows or len(rows) >= f.batch_rows or len(rows) > MAX_SAMPLES or any(
            len(idx) >= MAX_SAMPLES for idx in f.bad_samples.values()):
        return None  # (a list of MAX_SAMPLES may have been cut short: not every bad row)
    listed = ",".join(map(str, rows))
    return Rung("skip-samples", (f"skip-samples={f.step}:{listed}",),
                f"does it train with sample{'s' if len(rows) > 1 else ''} "
                f"{listed.replace(',', ', ')} of step {f.step}'s batch ({len(rows)} of "
                f"{f.batch_rows}) replaced by another of the batch?")


def _samples_text(e: Experiment) -> str:
    rows = sample_rows(parse_fix(e.fixes[0])) if e.fixes else []
    return (f"sample {rows[0]}" if len(rows) == 1 else
            "samples " + ", ".join(map(str, rows)))


def _run(ex: Experiments, rung: str) -> Experiment | None:
    return next((e for e in ex.runs if e.rung == rung and e.outcome != "not run"), None)


def _longest_run(indices: list[int]) -> int:
    best = run = 0
    prev = None
    for i in indices:
        run = run + 1 if prev is not None and i == prev + 1 else 1
        best, prev = max(best, run), i
    return best


def outcome(e: Experiment, original: Trace, rerun: Trace | None, *, exit_code: int,
            output_tail: str = "", timed_out: bool = False) -> Experiment:
    """Fill ``e`` from a re-run's report: its outcome and what showed it."""
    step = failure_step(original)
    if rerun is None:
        last = output_tail.strip().splitlines()[-1:] or [f"exit status {exit_code}"]
        e.outcome = "stopped" if timed_out else "crashed"
        e.detail = ("stopped: out of time before it wrote a report" if timed_out else
                    f"re-run crashed: {last[0][:200]}")
        return e
    steps = rerun.steps
    e.steps = len(steps)
    e.losses = [s.loss for s in steps]
    e.skipped = [s.index for s in steps if s.skipped]
    e.ended = rerun.run.status == "complete"
    f = rerun.first_failure
    if rerun.run.status == "crashed" and (f is None or (step is not None and f.step > step)):
        # an exception before anything went non-finite: never a training result
        same = original.run.status == "crashed" and original.first_failure is None and \
            (original.run.error or "").split(":")[0] == (rerun.run.error or "").split(":")[0]
        e.outcome = "recurred" if same else "crashed"
        e.detail = f"re-run crashed: {rerun.run.error or 'an exception'}" + \
            (f" (step {e.steps - 1})" if e.steps else " (before its first step)")
        return e
    if f is not None:
        e.failure, e.failure_step = f.where(), f.step
        e.outcome = "recurred" if f.step == step else "moved"
        e.detail = ("the failure recurred: " if e.outcome == "recurred" else
                    "first failure at another step: ") + f.where()
        return e
    bad = next((s for s in steps if s.loss is not None and not math.isfinite(s.loss)), None)
    applied = [s.index for s in steps if not s.skipped]
    late = [i for i in e.skipped if applied and i > applied[0]]
    blown = blew_up(original, steps)
    if e.rung == "control" and original.first_failure is None and rerun.problem and \
            same_problem(original, rerun):
        # the original's symptom (no non-finite value: a skip streak, a divergence) came back
        # in the unchanged script: reproduced, whatever form it took
        what = rerun.diagnosis.kind.replace("_", " ") if rerun.diagnosis else "a problem"
        e.outcome = "recurred"
        e.detail = f"the re-run has the same problem: {what}" + \
            (f" ({rerun.diagnosis.message[:160]})" if rerun.diagnosis else "")
    elif bad is not None:
        e.outcome, e.detail = "diverged", f"loss {bad.loss} at step {bad.index}"
    elif steps and not applied:
        e.outcome, e.detail = "diverged", f"GradScaler skipped all {len(steps)} steps"
    elif _longest_run(late) >= 2 or len(e.skipped) - len(late) > CALIBRATION_SKIPS:
        e.outcome = "diverged"
        e.detail = f"a run of {max(_longest_run(late), len(e.skipped) - len(late))} " \
            "skipped steps"
    elif blown:
        e.outcome, e.detail = "diverged", blown
    elif rerun.problem and same_problem(original, rerun):
        # the original's symptom (a failure with no non-finite value) came back
        what = rerun.diagnosis.kind.replace("_", " ") if rerun.diagnosis else "a problem"
        e.outcome = "recurred" if e.rung == "control" else "diverged"
        e.detail = f"the re-run has the same problem: {what}" + \
            (f" ({rerun.diagnosis.message[:160]})" if rerun.diagnosis else "")
    elif e.steps < e.target_steps and not e.ended:
        e.outcome = "stopped"
        e.detail = f"stopped after {e.steps} of {e.target_steps} steps ({rerun.run.status})"
    else:
        e.outcome = "trained"
        if rerun.problem and rerun.diagnosis is not None:
            # another finding of the rules in a run that trained: said, not the outcome
            e.detail = f"(its own diagnosis, not the original failure: " \
                f"{rerun.diagnosis.kind.replace('_', ' ')}) "
        span = [v for v in e.losses if v is not None]
        e.detail += (f"{e.steps} steps" + (" (the script's end)" if e.ended and
                                          e.steps < e.target_steps else "")
                    + (f", loss {span[0]:.4g} -> {span[-1]:.4g}" if span else "")
                    + (f", {len(e.skipped)} calibration skip" + ("s" if len(e.skipped) > 1
                                                                  else "")
                       if e.skipped else ""))
    return e


def blew_up(original: Trace, steps: list) -> str | None:
    """Why a re-run's loss blew up (BLOWUP x its base), or None. The base is its first loss, or,
    where the original failed with a non-finite value, its loss at that step when higher: the
    question is whether training goes on past the failure, and a loss that changed level there
    with the data (inputs in new units) did not diverge."""
    finite = [abs(s.loss) for s in steps if s.loss is not None and math.isfinite(s.loss)]
    if not finite:
        return None
    base, since = finite[0], "its first value"
    step = failure_step(original)
    at = [abs(s.loss) for s in steps if step is not None and s.index == step and
          s.loss is not None and math.isfinite(s.loss)]
    if original.first_failure is not None and at and at[0] > base:
        base, since = at[0], f"its value at step {step}"
    if base > 0 and max(finite) > BLOWUP * base:
        return f"the loss blew up: {max(finite):.3g}, {max(finite) / base:.0f}x {since} " \
            f"{base:.3g}"
    return None


def same_problem(original: Trace, rerun: Trace) -> bool:
    """Whether a re-run with no failure has the original's problem (same diagnosis kind), or
    any problem when the original had no diagnosis."""
    if original.diagnosis is None or rerun.diagnosis is None:
        return original.first_failure is None
    return rerun.diagnosis.kind == original.diagnosis.kind


def control_facts(ex: Experiments, original: Trace) -> None:
    """Whether the control reproduced the failure, and its losses against the original's."""
    c = _run(ex, "control")
    if c is None:
        return
    ex.control_reproduced = c.outcome == "recurred"
    step = ex.failure_step if ex.failure_step is not None else len(original.steps)
    a = [s.loss for s in original.steps if s.index < step]
    b = c.losses[: len(a)]
    if len(b) == len(a) and a:
        ex.deterministic = all(x == y or (x is not None and y is not None and math.isnan(x)
                                          and math.isnan(y)) for x, y in zip(a, b))
        gaps = [abs(x - y) for x, y in zip(a, b) if x is not None and y is not None
                and math.isfinite(x) and math.isfinite(y)]
        ex.spread = max(gaps) if gaps else None


def loss_gap(run: Experiment, reference: Experiment, ex: Experiments,
             control: Experiment | None) -> tuple[float, float] | None:
    """(how much higher ``run``'s loss is than ``reference``'s, the noise it is judged against),
    over the last steps both ran. The noise is the larger of the control's spread against the
    original run and the two runs' own difference before the failure step, doubled, and never
    less than 5% of the reference's loss there (float16 and float32 differ that much on a healthy
    run)."""
    n = min(len(run.losses), len(reference.losses))
    if n == 0:
        return None
    window = range(max(0, n - 5), n)
    a = [run.losses[i] for i in window]
    b = [reference.losses[i] for i in window]
    if any(v is None or not math.isfinite(v) for v in a + b):
        return None
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)  # type: ignore[arg-type]
    # a run with no failure step has no "before": its noise is the control's spread alone
    before = ex.failure_step if ex.failure_step is not None else 0
    early = [abs(x - y) for x, y in zip(run.losses[:before], reference.losses[:before])
             if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]
    noise = max([ex.spread or 0.0, *early]) * 2
    noise = max(noise, 0.05 * abs(mean_b))
    return mean_a - mean_b, noise


_PRECISION_KINDS = ("overflow", "underflow", "loss_scale")
_PRECISION_VERDICTS = ("precision", "precision-range", "precision-resolution", "loss-scaling")
#: what a failed rung did, in the words of the verdict
_FAILED = ("recurred", "moved", "diverged")
_NAMES = {
    "precision": "a precision failure (range or resolution not told apart)",
    "precision-range": "a precision failure of float16's range",
    "precision-resolution": "a precision failure of resolution (bfloat16 fails too)",
    "loss-scaling": "a loss-scaling failure",
    "optimisation": "an optimisation failure (the learning rate)",
    "data": "a data failure (the batch)",
    "not-precision": "not precision-specific: it fails in float32 too",
    "silent-precision": "a silent precision failure: it learns less than in float32",
}


def rung_value(e: Experiment) -> str:
    """What a rung's one fix was set to (``lr-factor=0.1`` -> ``"0.1"``), or ""."""
    return e.fixes[0].split("=", 1)[1] if e.fixes and "=" in e.fixes[0] else ""


def lines_width(spec: str) -> int:
    """How many lines an ``fp32-lines`` spec keeps in float32 (narrowest first in sorts)."""
    first, _, last = spec.rpartition(":")[2].partition("-")
    try:
        return int(last or first) - int(first) + 1
    except ValueError:
        return 0


def lines_runs(ex: Experiments) -> list[Experiment]:
    """The source rung's re-runs, narrowest first (they end in any order)."""
    return sorted((e for e in ex.runs if e.rung == "lines" and e.fixes),
                  key=lambda e: lines_width(e.fixes[0]))


def _lines_text(spec: str) -> str:
    """``fp32-lines:/a/train.py:56-57`` -> ``lines 56-57 of train.py``."""
    rest = spec.removeprefix("fp32-lines:")
    path, _, lines = rest.rpartition(":")
    word = "lines" if "-" in lines else "line"
    return f"{word} {lines} of {Path(path).name}"


def _how(e: Experiment, ex: Experiments | None = None) -> str:
    if ex is not None and unlearned(e, ex):
        return "finite, but it did not learn: loss " + loss_span(e.losses)
    return e.outcome + (f" at step {e.failure_step}" if e.outcome in ("recurred", "moved") and
                        e.failure_step is not None else "")


def loss_span(losses: list[float | None]) -> str:
    vals = [v for v in losses if v is not None]
    if not vals:
        return "not recorded"
    return f"{vals[0]:.4g} -> {vals[-1]:.4g}"


def drop(losses: list[float | None]) -> float | None:
    """How much a run's loss fell: the mean of its first quarter (at most 5 losses) less the
    mean of its last; None with fewer than 4 losses or a non-finite one among them."""
    if len(losses) < 4 or any(v is None or not math.isfinite(v) for v in losses):
        return None
    k = max(1, min(5, len(losses) // 4))
    return (sum(losses[:k]) - sum(losses[-k:])) / k  # type: ignore[arg-type]


def learning(e: Experiment, ex: Experiments) -> tuple[bool, str] | None:
    """Whether a fix's re-run learned: where the control's loss fell before the failure step
    (the run was learning), the fix's must fall over its run too; where it did not (a run that
    never learned, random targets), the fix's must at least not rise beyond the noise. None
    where either has too few finite losses to tell."""
    control = next((x for x in ex.runs if x.rung == "control"), None)
    if control is None or ex.failure_step is None:
        return None
    losses = control.losses[: ex.failure_step]
    before = drop(losses)
    after = drop(e.losses)
    if before is None or after is None:
        return None
    # the noise of the drop: the control's own step-to-step scatter, for means of k losses
    # (a deterministic control has no spread against the original, but a noisy loss still
    # falls or rises by chance), and twice the control's spread against the original
    k = max(1, min(5, len(losses) // 4))
    diffs = [b - a for a, b in itertools.pairwise(losses)]  # type: ignore[operator]
    scatter = statistics.pstdev(diffs) / math.sqrt(k) if len(diffs) >= 3 else 0.0
    noise = 2 * max(ex.spread or 0.0, scatter)
    span = f"{loss_span(e.losses)}"
    if before > noise:
        return (after > 0, f"it did not learn: its loss went {span} while the control's fell "
                           f"by {before:.3g} before the failure")
    return (after >= -max(noise, 0.05 * abs(e.losses[0] or 0.0)),  # type: ignore[operator]
            f"its loss rose: {span}")


def cured(e: Experiment | None, ex: Experiments) -> bool:
    """A rung that removed the failure: it trained (ran to the horizon, finite, no skip streak)
    and, where the control was learning before the failure, learned too (:func:`learning`): a
    re-run that stayed finite while its loss rose is another failure, not a cure."""
    if e is None or e.outcome != "trained":
        return False
    learned = learning(e, ex)
    return learned is None or learned[0]


def unlearned(e: Experiment | None, ex: Experiments) -> bool:
    """A rung that trained without learning (:func:`cured` is False for it)."""
    return e is not None and e.outcome == "trained" and not cured(e, ex)


def classify(ex: Experiments, trace: Trace) -> None:
    """The verdict of the experiments, the one that proves it, and a contradicted rule."""
    if ex.control_reproduced is False:
        c = _run(ex, "control")
        ex.verdict = "not-reproduced"
        ex.verdict_text = ("the failure did not recur in an unfixed re-run (control: "
                           f"{c.detail if c else 'no result'}): nothing is verified")
        return
    if ex.control_reproduced is None:
        ex.verdict = "undetermined"
        ex.verdict_text = "the control did not run: no experiment can be read"
        return
    fp32, bf16 = _run(ex, "fp32"), _run(ex, "bf16")
    noscale, scale = _run(ex, "no-scaler"), _run(ex, "init-scale")
    growth = _run(ex, "growth-interval")
    master = _run(ex, "fp32-master")
    said: list[str] = []
    verdict = "undetermined"
    name = ""
    if cured(fp32, ex):
        if cured(noscale, ex):
            verdict, mid = "loss-scaling", "disabling GradScaler does too"
        elif cured(scale, ex):
            verdict = "loss-scaling"
            mid = (f"GradScaler from init_scale {rung_value(scale)} (the gradients' exponents) "
                   "does too")
        elif cured(growth, ex):
            verdict = "loss-scaling"
            mid = (f"GradScaler growing every {rung_value(growth)} steps (to the scale the "
                   "gradients' exponents call for) does too")
        elif cured(bf16, ex):
            verdict, mid = "precision-range", "bfloat16 does too"
        elif bf16 is not None and (bf16.outcome in _FAILED or unlearned(bf16, ex)):
            verdict, mid = "precision-resolution", f"bfloat16 does not ({_how(bf16, ex)})"
        elif bf16 is None and not _float16(trace):
            verdict, mid = "precision-resolution", "the run is bfloat16 already (float32's range)"
        else:  # bfloat16 did not run (the budget) or crashed: range or resolution unknown
            verdict, mid = "precision", "bfloat16 was not tried to completion"
        if ex.lines:
            # the locator's line: the ops written there, in float32, are the cure
            said.append(f"keeping the ops written on {_lines_text(ex.lines)} in float32 "
                        "removes the failure")
            narrower = [e for e in lines_runs(ex) if e.outcome in _FAILED and
                        lines_width(e.fixes[0]) < lines_width(ex.lines)]
            if narrower:
                said.append(" or ".join(_lines_text(e.fixes[0]) for e in narrower if e.fixes)
                            + " alone does not")
        if cured(master, ex):
            # the narrowest change of all: only the optimizer's arithmetic leaves 16 bits
            said.append("float32 master weights and optimizer state remove the failure (the "
                        "forward and backward still in low precision)")
            name = _NAMES[verdict] + ", in the optimizer's 16-bit weights and state"
        if ex.region:
            # the narrowest experiment that proves it first (DESIGN.md §9)
            region = ex.region.removeprefix("fp32:")
            kept = region.endswith("..")
            said += [f"keeping `{region.removesuffix('..')}` in float32"
                     + (" (its output too)" if kept else "") + " removes the failure", mid,
                     "float32 everywhere does"]
        else:
            said += ["float32 everywhere removes the failure", mid]
            if ex.region_text:
                said.append(ex.region_text)
        if master is not None and (master.outcome in _FAILED or unlearned(master, ex)):
            said.append(f"float32 master weights alone do not ({_how(master, ex)})")
        tried = [e for e in lines_runs(ex) if e.outcome in _FAILED]
        if tried and not ex.lines:  # the failing op's own lines are not where it was lost
            said.append(f"float32 for the ops written on {_lines_text(tried[-1].fixes[0])} "
                        f"(where the first non-finite value was made) does not "
                        f"({_how(tried[-1], ex)})")
    elif fp32 is None or fp32.outcome in _FAILED or unlearned(fp32, ex):
        if fp32 is None:
            said.append("the run used no low-precision format")
        else:
            said.append(f"float32 everywhere does not remove it ({_how(fp32, ex)})")
        lrs = [e for e in (_run(ex, "lr-0.1"), _run(ex, "lr-0.01")) if e is not None]
        lr = next((e for e in lrs if cured(e, ex)), None)
        clip = _run(ex, "clip")
        skips = batch_runs(ex)
        skip = cured_batch(ex)
        sample = _run(ex, "skip-samples")
        if cured(sample, ex):
            # the narrowest change that removes it: the named samples alone (checked first: a
            # lower lr that only survives the bad rows is no cure of the data)
            verdict = "data"
            step_of = rung_value(sample).split(":")[0]
            name = f"a data failure ({_samples_text(sample)} of step {step_of}'s batch)"
            said.append(f"replacing {_samples_text(sample)} of the failing batch removes it")
        elif lr is not None:
            verdict = "optimisation"
            said.append(f"a learning rate x{rung_value(lr)} removes it")
        elif cured(clip, ex):
            verdict = "optimisation"
            name = "an optimisation failure (the gradient norm)"
            said.append(f"clipping the gradient norm at {rung_value(clip)} removes it")
        elif skip is not None:
            verdict = "data"
            name = f"a data failure (the batch of step {rung_value(skip)})"
            said.append(f"replacing step {rung_value(skip)}'s batch removes it")
        else:
            verdict = "not-precision"
            if lrs:
                said.append("a learning rate " + " or ".join(f"x{rung_value(e)}" for e in lrs)
                            + " does not (" + ", ".join(_how(e, ex) for e in lrs) + ")")
            if clip is not None:
                said.append(f"clipping at {rung_value(clip)} does not ({_how(clip, ex)})")
            if skips:
                said.append(batches_said(skips, lambda e: cured(e, ex),
                                         ", ".join(_how(e, ex) for e in skips)))
            if sample is not None:
                said.append(f"replacing {_samples_text(sample)} does not ({_how(sample, ex)})")
            if fp32 is None:
                name = "nothing tried removes it"
    else:
        said.append(f"the float32 experiment {fp32.outcome}: {fp32.detail}")
    ex.verdict = verdict
    name = name or _NAMES.get(verdict, "")
    ex.verdict_text = "; ".join(said) + (f": {name}" if name else "")
    ex.contradiction = contradiction(ex, trace)


def contradiction(ex: Experiments, trace: Trace) -> str:
    """Why the rules' cause loses to the experiments, or "" where they agree (or cannot tell).

    A precision kind (overflow, underflow, loss scale) loses when the failure recurs in float32
    everywhere; the learning rate or exploding gradients when float32 everywhere removes it; the
    learning rate when every learning-rate rung that ran fails the same way (none moved the
    failure); exploding gradients when clipping at the measured norm and every learning-rate rung
    fail the same way."""
    diag = trace.diagnosis
    kind = diag.kind if diag is not None else ""
    said = kind.replace("_", " ")
    fp32 = _run(ex, "fp32")
    lrs = [e for e in (_run(ex, "lr-0.1"), _run(ex, "lr-0.01")) if e is not None]
    clip = _run(ex, "clip")
    same = ("recurred", "diverged")  # a rung that moved the failure changed something
    if kind in _PRECISION_KINDS and fp32 is not None and fp32.outcome in _FAILED:
        return (f"the rules called it {said}, a precision failure, but it recurs in float32 "
                f"everywhere ({_how(fp32)}): the experiments win")
    if kind in ("lr_too_high", "exploding_gradient") and ex.verdict in _PRECISION_VERDICTS:
        return (f"the rules called it {said}, but float32 everywhere removes the failure: a "
                "precision failure, the experiments win")
    if kind == "lr_too_high" and lrs and all(e.outcome in same for e in lrs):
        return (f"the rules called it {said}, but a learning rate "
                + " and ".join(f"x{rung_value(e)}" for e in lrs) + " fail the same way ("
                + ", ".join(e.outcome for e in lrs) + "): not the learning rate, the "
                "experiments win")
    if kind == "exploding_gradient" and clip is not None and clip.outcome in same and \
            all(e.outcome in same for e in lrs):
        return (f"the rules called it {said}, but clipping the gradient norm at {rung_value(clip)}"
                + (" and a learning rate " + " and ".join(f"x{rung_value(e)}" for e in lrs)
                   if lrs else "") + " fail the same way: not the gradient's growth, the "
                "experiments win")
    return ""


def silent_candidate(trace: Trace) -> bool:
    """A run with no problem found that an experiment can judge: run to its end, long enough
    to learn, and in mixed precision (the float32 comparison), or with a structure that calls
    for an experiment (:func:`suspect_rungs`), or with a loss that blew up to BLOWUP x its first
    value that no rule explained (the control and the learning-rate rungs say whether it
    diverged and why)."""
    return (not trace.problem and trace.run.status == "complete" and
            len(trace.steps) >= MIN_SILENT_STEPS and
            all(s.loss is not None and math.isfinite(s.loss) for s in trace.steps) and
            (uses_low_precision(trace) or bool(suspect_rungs(trace)) or
             blew_up(trace, trace.steps) is not None))


#: a run "learns less" than float32 only by at least this share of what float32 learned (its
#: first loss less its mean over the last steps): two precisions' trajectories part by a few
#: percent on a healthy run, systematically (CPU float16 autocast keeps softmax in float16)
SILENT_SHARE = 0.10
#: a warm-up "helps" only where the control's loss is above the warm-up's by at least this
#: share of what the warm-up's loss fell
WARMUP_GAIN = 0.25


def warmup_verdict(ex: Experiments, trace: Trace) -> Finding | None:
    """Whether a post-LN run with no warm-up learns measurably less than its warm-up experiment
    at the same steps: the control's mean loss over the last steps above the warm-up's by more
    than the noise (:func:`loss_gap`) and by at least :data:`WARMUP_GAIN` of what the warm-up's
    loss fell, the warm-up's having fallen beyond the noise. The finding, or None."""
    control, warm = _run(ex, "control"), _run(ex, "warmup")
    if control is None or warm is None:
        return None

    def say(text: str) -> None:
        ex.verdict_text = "; ".join(filter(None, [ex.verdict_text, text]))

    if control.outcome != "trained" or warm.outcome != "trained":
        say(f"the warm-up experiment {warm.outcome} ({warm.detail})"
            if warm.outcome != "trained" else
            f"no warm-up comparison: the control {control.outcome} ({control.detail})")
        return None
    gap = loss_gap(control, warm, ex, control)
    n = min(len(control.losses), len(warm.losses))
    start = warm.losses[0] if warm.losses else None
    if gap is None or n == 0 or start is None:
        say("no warm-up comparison: no common finite losses")
        return None
    diff, noise = gap
    window = warm.losses[max(0, n - 5):n]
    end = sum(v for v in window if v is not None) / len(window)
    gain = start - end
    k = rung_value(warm)
    where = f"over steps {max(0, n - 5)}-{n - 1}"
    said = (f"with a linear warm-up over {k} steps (--fix {warm.fixes[0]}) the mean loss {where} "
            f"is {end:.4g}; this run's control {end + diff:.4g}")
    if not (diff > noise and gain > noise and diff >= WARMUP_GAIN * gain):
        say(f"no gain from a warm-up: {said} ({diff:+.3g}, noise {noise:.3g})")
        return None
    blocks = [b for b, _ in post_ln_blocks(trace)]
    lr = no_warmup(trace)
    ex.verdict = "optimisation"
    text = (f"{said}: {diff:.3g} higher, beyond the noise {noise:.3g}, and "
            f"{diff / gain:.0%} of what the warm-up's loss fell: the learning rate at the start "
            "(a post-LN transformer without warm-up)")
    ex.verdict_text = "; ".join(filter(None, [ex.verdict_text, text]))
    return Finding(
        rule="post-ln-warmup", kind="lr_too_high", severity="error", phase="optimizer", step=0,
        module=blocks[0] if blocks else None, score=7.0,
        message=(f"a post-LN transformer ({blocks[0] if blocks else 'its blocks'} and its like) "
                 + (f"trained at lr {lr:.3g}" if lr is not None else "trained at its full lr")
                 + " from the first step learns measurably less than with "
                 f"a warm-up: mean loss {end + diff:.4g} against {end:.4g} {where}"),
        evidence=[f"{len(blocks)} post-LN block{'s' if len(blocks) != 1 else ''} "
                  f"({', '.join(blocks[:4])}{', ...' if len(blocks) > 4 else ''}): each "
                  "normalises after its sublayers' residual add (Xiong et al. 2020: post-LN "
                  "needs a warm-up)", text],
        data={"blocks": blocks, "lr": lr, "warmup": int(float(k)) if k else None,
              "gap": diff, "noise": noise, "warmup_loss": end})


def _diverged_at(e: Experiment) -> int:
    """Where a re-run diverged: its first non-finite loss, its first loss above BLOWUP x its
    first, or the first step of its longest run of skipped steps; its last step otherwise."""
    bad = next((i for i, v in enumerate(e.losses) if v is not None and not math.isfinite(v)),
               None)
    if bad is not None:
        return bad
    first = next((v for v in e.losses if v is not None), None)
    if first is not None and first != 0:
        big = next((i for i, v in enumerate(e.losses)
                    if v is not None and abs(v) > BLOWUP * abs(first)), None)
        if big is not None:
            return big
    if e.skipped:
        runs, start = [], None
        s = sorted(e.skipped)
        for i, v in enumerate(s):
            if i == 0 or v != s[i - 1] + 1:
                start = v
            runs.append((v - start, -start))  # type: ignore[operator]
        return -max(runs)[1]
    return max(0, len(e.losses) - 1)


def _scaler_cycles(e: Experiment, trace: Trace) -> bool:
    """Whether a re-run's only trouble is GradScaler skipping steps as the original run did,
    which the rules found healthy (its growth-then-backoff cycle: a scale that grows every
    growth_interval steps overflows and halves, sometimes twice in a row): its losses finite and
    not blown up, its longest run of skipped steps and their count no worse than the original's
    over the steps it ran (a re-run stopped at --max-steps ran fewer; skips may shift a step),
    and under half its steps skipped."""
    if e.outcome != "diverged" or "skipped" not in e.detail or not e.skipped:
        return False
    if any(v is None or not math.isfinite(v) for v in e.losses):
        return False
    first = next((v for v in e.losses if v is not None), None)
    if first is not None and first != 0 and max(abs(v) for v in e.losses  # type: ignore[arg-type]
                                                ) > BLOWUP * abs(first):
        return False
    ran = len(e.losses)
    original = sorted(s.index for s in trace.steps if s.skipped and s.index < ran)
    return (bool(original) and _longest_run(sorted(e.skipped)) <= _longest_run(original) and
            len(e.skipped) <= len(original) and len(e.skipped) < ran / 2)


def excuse_cycles(e: Experiment | None, trace: Trace) -> None:
    """A re-run whose skips are the original's growth-and-backoff cycle trained, as the original
    did: say so in its outcome."""
    if e is not None and _scaler_cycles(e, trace):
        e.outcome = "trained"
        e.detail = (f"{e.steps} steps, loss {loss_span(e.losses)}, {len(e.skipped)} skipped "
                    "steps like the original run's (GradScaler's growth and backoff)")


def _by_updates(run: Experiment, control: Experiment) -> tuple[Experiment, int]:
    """``run``'s losses at the control's steps, each taken where ``run`` had applied as many
    updates as the control had before that step (``run`` skipped none), and how many steps the
    control skipped; ``run`` itself where the control skipped none."""
    skipped = set(control.skipped)
    if not skipped or run.skipped:
        return run, 0
    losses, applied = [], 0
    for i in range(len(control.losses)):
        losses.append(run.losses[applied] if applied < len(run.losses) else None)
        if i not in skipped:
            applied += 1
    return dataclasses.replace(run, losses=losses), len(skipped)


def silent_verdict(ex: Experiments, trace: Trace) -> Finding | None:
    """Whether a run with no non-finite value learns measurably less than float32 everywhere at
    the same step, beyond the control's spread: the finding that says so, or None."""
    control, fp32 = _run(ex, "control"), _run(ex, "fp32")
    low = uses_low_precision(trace)
    if control is None or (fp32 is None and low):
        ex.verdict, ex.verdict_text = "undetermined", "the control or the float32 experiment " \
            "did not run"
        return None
    for e in ex.runs:  # the original's scaler cycles, skips and all: trained as it did
        excuse_cycles(e, trace)
    ex.control_reproduced = control.outcome == "trained"
    if control.outcome == "diverged":
        # the script, re-run unchanged, diverged (a loss 10x its first, a skip streak) with
        # nothing non-finite traced: never OK; float32 everywhere says whether precision is
        # the cause, where it ran to its end
        precision = fp32 is not None and fp32.outcome == "trained"
        ex.control_reproduced = True
        if fp32 is None:
            ex.verdict, said = "not-precision", "the run is in float32: not precision-specific"
        elif precision:
            ex.verdict, said = "precision-range", "float32 everywhere trains: a precision failure"
        elif fp32.outcome in _FAILED:
            ex.verdict = "not-precision"
            said = f"float32 everywhere {fp32.outcome} too ({fp32.detail}): not precision-specific"
        else:  # crashed or stopped: precision neither shown nor ruled out
            ex.verdict = "undetermined"
            said = f"the float32 experiment {fp32.outcome} ({fp32.detail}): precision not told"
        ex.verdict_text = "the script re-run unchanged diverges; " + said
        return Finding(rule="experiment-divergence", kind="divergence", severity="error",
                       message=f"the training diverged: {control.detail}",
                       evidence=[ex.verdict_text], step=_diverged_at(control))
    if control.outcome != "trained":
        ex.verdict = "undetermined"
        ex.verdict_text = f"the control {control.outcome} ({control.detail})"
        return None
    if blew_up(trace, trace.steps) is not None and blew_up(trace, [
            StepRecord(index=i, loss=v) for i, v in enumerate(control.losses)]) is None:
        ex.verdict = "not-reproduced"
        ex.verdict_text = (f"the original run's loss blew up ({blew_up(trace, trace.steps)}); "
                           f"re-run unchanged it did not ({control.detail})")
        return None
    if fp32 is None:  # a float32 run: no precision comparison to make
        ex.verdict, ex.verdict_text = "", ""
        return None
    if fp32.outcome != "trained" or control.outcome != "trained":
        ex.verdict = "undetermined"
        ex.verdict_text = (f"the float32 experiment {fp32.outcome} ({fp32.detail})"
                           if fp32.outcome != "trained" else
                           f"the control {control.outcome} ({control.detail})")
        return None
    # GradScaler's skipped steps are its price, not a precision loss: float32 is compared at
    # the same number of applied updates (its loss after as many updates as the control had)
    reference, handicap = _by_updates(fp32, control)
    gap = loss_gap(control, reference, ex, control)
    n = min(len(control.losses), len(fp32.losses))
    if gap is None or n == 0:
        ex.verdict, ex.verdict_text = "undetermined", "no common finite losses to compare"
        return None
    diff, noise = gap
    start = fp32.losses[0]
    window = [v for v in reference.losses[max(0, n - 5):n] if v is not None]
    end = sum(window) / len(window) if window else math.nan
    learned = start is not None and start - end > noise
    material = start is not None and diff >= SILENT_SHARE * (start - end)
    where = f"over steps {max(0, n - 5)}-{n - 1}" + (
        f" (float32's at as many applied updates: GradScaler skipped {handicap} of the "
        "control's steps, its price, not a precision loss)" if handicap else "")
    if diff > noise and learned and material:
        ex.verdict = "silent-precision"
        ex.verdict_text = (f"float32 everywhere reaches a mean loss of {end:.4g} {where}; this "
                           f"run's control {end + diff:.4g}: {diff:.3g} higher, beyond the noise "
                           f"{noise:.3g} (the control against the original run differs by "
                           f"{ex.spread or 0:.3g}): {_NAMES['silent-precision']}")
        return Finding(
            rule="experiment-silent-precision", kind="silent_precision", severity="error",
            message=("the run learns measurably less than the same script in float32 "
                     f"everywhere: mean loss {end + diff:.4g} against {end:.4g} {where}"),
            evidence=[ex.verdict_text], step=n - 1,
            data={"gap": diff, "noise": noise, "fp32_loss": end})
    ex.verdict = ""
    ex.verdict_text = (
        "float32 everywhere does not learn measurably either: no comparison" if not learned else
        f"no silent precision loss: the loss is within {noise:.3g} of float32 everywhere "
        f"{where} ({diff:+.3g})" if diff <= noise else
        f"no material precision loss: the loss is {diff:.3g} above float32 everywhere's {where}, "
        f"beyond the noise {noise:.3g} but {diff / (start - end):.0%} of what float32 learned "
        f"({start:.4g} -> {end:.4g}; a silent failure needs {SILENT_SHARE:.0%})")
    return None
