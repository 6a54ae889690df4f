"""What the terminal and HTML renderers share: the verdict, the module ranking, number formatting.

Everything here reads a :class:`~nanhunt.trace.Trace` and returns plain values, so both renderers
say the same thing in the same words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nanhunt.errors import NanhuntError
from nanhunt.formats import NumberFormat, get_format
from nanhunt.trace import Failure, Finding, LayerStats, RankSummary, StepRecord, TensorStats, Trace

#: Headroom (binades below the target max) under which a module is shown as at risk.
WARN_HEADROOM = 2.0

_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def target_format(trace: Trace) -> NumberFormat:
    """The format the run is judged against; float16 when the recorded name is unknown."""
    try:
        return get_format(trace.run.target or "float16")
    except NanhuntError:
        return get_format("float16")


def fmt_num(x: float | None) -> str:
    """A magnitude in at most ~9 characters: ``0``, ``210``, ``0.0312``, ``6.55e+04``, ``inf``."""
    if x is None:
        return "—"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    a = abs(x)
    if 1e-3 <= a < 1e4:
        return f"{x:.4g}"
    return f"{x:.2e}"


def fmt_count(n: int) -> str:
    return f"{n:,}"


def fmt_compact(n: int) -> str:
    """A count in at most 5 characters: ``42``, ``9,999``, ``131k``, ``2.1M``."""
    if n < 10_000:
        return f"{n:,}"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            v = n / div
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return str(n)


def fmt_pct(frac: float) -> str:
    """A fraction in at most 5 characters: ``0%``, ``<0.1%``, ``2.3%``, ``31%``."""
    if frac <= 0:
        return "0%"
    if frac < 0.001:
        return "<0.1%"
    if frac < 0.1:
        return f"{100 * frac:.1f}%"
    return f"{100 * frac:.0f}%"


def pow2(x: float) -> int | None:
    """``k`` when ``x == 2**k`` exactly, else None."""
    if not (x > 0 and math.isfinite(x)):
        return None
    m, e = math.frexp(x)
    return e - 1 if m == 0.5 else None


def superscript(k: int) -> str:
    return str(k).translate(_SUPERSCRIPT)


def fmt_scale(x: float | None) -> str:
    """A loss scale: ``65536 (2^16)`` when it is a power of two."""
    if x is None:
        return "—"
    k = pow2(x)
    if k is not None and -30 <= k <= 30:
        return f"{x:.0f} (2^{k})" if k >= 0 else f"2^{k}"
    return fmt_num(x)


def fmt_scale_short(x: float) -> str:
    """A loss scale in few characters: ``2^16``, or the number when not a power of two."""
    k = pow2(x)
    return f"2^{k}" if k is not None else fmt_num(x)


def fmt_binades(h: float) -> str:
    if math.isnan(h):
        return "nan"
    if math.isinf(h):
        return "—" if h > 0 else "-inf"
    # at most 5 characters: +12.4, -3.0, +127 (a float32 or bfloat16 target)
    return f"{h:+.1f}" if abs(h) < 99.95 else f"{h:+.0f}"


def fmt_value(value: Any) -> str:
    """A recommendation's value as the user would type it."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        k = pow2(value)
        return f"{value:g} (2^{k})" if k is not None and abs(k) >= 4 else fmt_num(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt_value(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={fmt_value(v)}" for k, v in value.items())
    return str(value)


def plural(n: int, word: str, words: str | None = None) -> str:
    return f"{n} {word if n == 1 else (words or word + 's')}"


def bad_samples_text(indices: list[int], limit: int = 8) -> str:
    """Sample indices, the first few of them: ``3, 17, 42 (+5 more)``."""
    text = ", ".join(str(i) for i in indices[:limit])
    return text + (f" (+{len(indices) - limit} more)" if len(indices) > limit else "")


def reduction_text(ff: Failure) -> str | None:
    """For a failure in the reduction across ranks: how it was reduced, in which dtype, and this
    rank's own gradient before it (``None`` for other phases)."""
    if ff.phase != "communication" or not ff.reduction:
        return None
    text = ff.reduction + (f", in {ff.reduce_dtype}" if ff.reduce_dtype else "")
    local = ff.local_grad
    if local is None:
        return text + "; this rank's gradient before it: not observed"
    state = "finite" if not local.nonfinite else f"{local.nonfinite} non-finite"
    return text + f"; this rank's gradient before it: {state}, amax {local.amax:.3g}"


def first_line(text: str | None, limit: int = 160) -> str:
    """The most telling line of an error message: the last non-empty one (a traceback's end)."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


# ----------------------------------------------------------------------------- verdict


@dataclass(frozen=True)
class Verdict:
    """The one-line answer at the top of every report.

    ``level`` is ``problem``, ``ok`` or ``partial``. ``partial`` (the run crashed, was interrupted
    or is still running) is a line shown above ``headline``, which is always the problem/OK line.
    """

    level: str
    headline: str
    partial: str | None = None
    note: str | None = None  # shown under the headline: "the script exited with 3"


def has_problem(trace: Trace) -> bool:
    diag_error = trace.diagnosis is not None and trace.diagnosis.severity == "error"
    return trace.problem or trace.first_failure is not None or diag_error


#: how a session's trace notes an internal error of nanhunt's (capture/session.py)
INTERNAL_ERROR_NOTE = "nanhunt stopped tracing after an internal error"


def partial_line(trace: Trace) -> str | None:
    if not trace.partial:
        if any(n.startswith(INTERNAL_ERROR_NOTE) for n in trace.notes):
            # nothing found may only mean nothing was recorded after the error
            return "PARTIAL REPORT (nanhunt stopped tracing after an internal error, see notes)"
        return None
    status = trace.run.status
    error = first_line(trace.run.error)
    if status == "crashed":
        why = f"script crashed: {error}" if error else "script crashed"
    elif status == "interrupted":
        why = f"interrupted: {error}" if error else "interrupted"
    else:
        why = "run still in progress"
    return f"PARTIAL REPORT ({why})"


def exit_note(trace: Trace) -> str | None:
    """The script's own non-zero exit status, when it ended by itself (``sys.exit(3)``)."""
    code = trace.run.exit_code
    if code in (None, 0) or trace.run.status not in ("complete", "exited"):
        return None
    return f"the script exited with {code}"


def ran_no_step(trace: Trace) -> bool:
    """The script ended before its first training step (its --help, an argparse error)."""
    ran = trace.steps or trace.layers or trace.facts or trace.warnings
    return not ran and trace.run.status != "running"


def verdict(trace: Trace) -> Verdict:
    partial = partial_line(trace)
    note = exit_note(trace)
    if has_problem(trace):
        return Verdict("problem", "PROBLEM: " + _problem_text(trace) + rank_scope(trace)
                       + experiment_clause(trace), partial, note)
    if ran_no_step(trace):  # nothing was checked: no OK verdict
        ended = "exited" if trace.run.status in ("complete", "exited") else "stopped"
        return Verdict("partial", f"the script {ended} before any training step", partial, note)
    n_warn = plural(len(trace.warnings), "warning")
    so_far = " so far" if partial else ""
    if trace.facts:
        benign = plural(len(trace.facts), "expected non-finite event")
        text = f"OK{so_far}: no problem found ({benign}, see facts); {n_warn}"
    else:
        text = f"OK{so_far}: no non-finite values; {n_warn}"
    return Verdict("partial" if partial else "ok", text, partial, note)


def _problem_text(trace: Trace) -> str:
    diag = trace.diagnosis
    kind = (diag.kind if diag else "") or "non-finite value"
    kind = kind.replace("_", " ")
    ex = trace.experiments
    if ex is not None and ex.contradiction and ex.source == "experiments":
        # the rules' cause lost to the experiments: the headline does not lead with it
        return _problem_text_of(trace, "failure") + \
            f" (not {kind}: the experiments contradict it)"
    return _problem_text_of(trace, kind)


def _problem_text_of(trace: Trace, kind: str) -> str:
    diag = trace.diagnosis
    ff = trace.first_failure
    if diag is not None and diag.rule == "untraced-step" and ff is not None:
        why = "step not traced" if ff.observed else \
            "step not replayed" if "was not replayed" in (ff.detail or "") else \
            "weights non-finite before the step"
        return f"non-finite {ff.tensor} at step {ff.step}: origin not observed ({why})"
    if diag is not None and ff is not None and (diag.phase or diag.module):
        # the cause, not where the symptom surfaced: a collapse caused by a backward op is
        # that op's, in backward; a misused GradScaler is the loop's line, not a module
        phase = diag.phase or ff.phase
        step = diag.step if diag.step is not None else ff.step
        module = diag.module if diag.phase else diag.module or ff.module
        tensor = diag.tensor if diag.phase and diag.phase != ff.phase else ff.tensor
    elif ff is not None:
        phase, step, module, tensor = ff.phase, ff.step, ff.module, ff.tensor
    elif diag is not None:
        phase, step, module, tensor = diag.phase, diag.step, diag.module, diag.tensor
    else:
        return kind
    parts = [kind]
    if phase:
        parts.append(f"in {phase}")
    if step is not None:
        parts.append(f"at step {step}")
    text = " ".join(parts)
    if module:
        text += f", module {module}"
        if ff is not None and ff.op and diag is not None and diag.kind == "nan_op":
            text += f" ({ff.op.removesuffix('.default')})"
    elif diag is not None and diag.data.get("source"):
        text += f", at {diag.data['source']}"  # the user's line (loop misuse, a constant)
    elif tensor:
        text += f", tensor {tensor}"
    elif diag is not None and not ff:
        text += f": {diag.message}"
    return text


def rank_scope(trace: Trace) -> str:
    """Where a distributed run failed, for the verdict: `` on rank 1``, `` on every rank (4 of
    4)``, `` on every rank that answered (3 of 4)``; empty for one process."""
    ff = trace.first_failure
    world = trace.run.world_size
    if ff is None or ff.rank is None or world <= 1:
        return ""
    if trace.all_ranks_failed:
        return f" on every rank ({world} of {world})"
    answered = [r for r in trace.ranks if r.answered]
    alike = [r for r in answered if r.first_failure is not None and same_place(r.first_failure, ff)]
    if len(alike) > 1 and len(alike) == len(answered):
        if len(alike) == world:
            return f" on every rank ({world} of {world})"
        return f" on every rank that answered ({len(alike)} of {world})"
    return f" on rank {ff.rank}"


def same_place(a: Failure, b: Failure) -> bool:
    return (a.step, a.phase, a.module, a.tensor) == (b.step, b.phase, b.module, b.tensor)


def shape_text(stats: TensorStats) -> str:
    """``64×512``; ``scalar`` for a 0-d tensor (a loss); ``?`` when the shape was not kept."""
    if stats.shape:
        return "×".join(str(d) for d in stats.shape)
    return "scalar" if stats.numel == 1 else "?"


def values_summary(stats: TensorStats, fmt: NumberFormat) -> list[str]:
    """Short phrases describing a tensor's values against the target format."""
    finite = stats.numel - stats.nonfinite
    out = [f"amax {fmt_num(stats.amax)}" if finite else "no finite value"]
    if stats.posinf or stats.neginf:
        out.append(f"{fmt_count(stats.posinf)} +inf, {fmt_count(stats.neginf)} -inf")
    else:
        out.append("0 inf")
    out.append(f"{fmt_count(stats.nan)} nan")
    if stats.overflow:  # finite values only; NaN/inf are counted above
        out.append(f"{fmt_count(stats.overflow)} finite over {fmt.name} max")
    elif not stats.nonfinite:
        out.append(f"headroom {fmt_binades(stat_headroom(stats, fmt))} binades")
    if stats.zero:
        out.append(f"{fmt_count(stats.zero)} exact zeros")
    if stats.underflow:
        n = stats.underflow - stats.flushed
        if n:
            out.append(f"{fmt_count(n)} subnormal in {fmt.name}")
        if stats.flushed:
            out.append(f"{fmt_count(stats.flushed)} would flush to zero in {fmt.name}")
    return out


# ----------------------------------------------------------------------------- modules


def stat_headroom(stats: TensorStats | None, fmt: NumberFormat) -> float:
    """Binades from a tensor's amax to the target max; -inf once anything overflowed."""
    if stats is None:
        return math.inf
    if stats.nonfinite:
        return -math.inf
    h = fmt.headroom_binades(stats.amax)
    recorded = stats.headroom
    return min(h, recorded) if not math.isnan(recorded) else h


def headroom_class(headroom: float, nonfinite: int = 0) -> str:
    """``bad`` (overflowed or non-finite), ``warn`` (< WARN_HEADROOM binades) or ``ok``."""
    if nonfinite or headroom < 0 or math.isnan(headroom):
        return "bad"
    if headroom < WARN_HEADROOM:
        return "warn"
    return "ok"


@dataclass(frozen=True)
class ModuleRow:
    """One line of the per-module table."""

    index: int  # position in execution order
    module: str
    type: str
    fwd_amax: float | None
    bwd_amax: float | None
    headroom: float
    underflow: float  # fraction of finite non-zero values below the target's smallest normal
    nonfinite: int
    culprit: bool

    @property
    def level(self) -> str:
        return headroom_class(self.headroom, self.nonfinite)


def layer_row(index: int, layer: LayerStats, fmt: NumberFormat, culprit: str | None,
              *, scaled: bool = False) -> ModuleRow:
    parts = [s for s in (layer.forward, layer.backward) if s is not None]
    merged = parts[0].merged(parts[1]) if len(parts) == 2 else (parts[0] if parts else None)
    nonfinite = sum(s.nonfinite for s in (*parts, layer.param_grad) if s is not None)
    # under GradScaler the gradients are scaled up to the limit on purpose, and an overflow
    # there is skipped and backed off: only the forward pass is judged against the max
    judged = [layer.forward] if scaled and layer.forward is not None else parts
    # the headroom of the finite values; non-finite ones are counted in their own column
    headroom = min((stat_headroom(s, fmt) for s in judged), default=math.inf)
    return ModuleRow(
        index=index,
        module=layer.module,
        type=layer.type,
        fwd_amax=layer.forward.amax if layer.forward else None,
        bwd_amax=layer.backward.amax if layer.backward else None,
        headroom=headroom,
        underflow=merged.underflow_fraction if merged else 0.0,
        nonfinite=nonfinite,
        culprit=bool(culprit) and layer.module == culprit,
    )


def culprit_module(trace: Trace) -> str | None:
    if trace.first_failure is not None and trace.first_failure.module:
        return trace.first_failure.module
    if trace.diagnosis is not None and trace.diagnosis.module:
        return trace.diagnosis.module
    return None


def module_rows(trace: Trace, fmt: NumberFormat) -> list[ModuleRow]:
    """Every module, worst first: the culprit, then non-finite ones, then by lowest headroom."""
    culprit = culprit_module(trace)
    rows = [layer_row(i, layer, fmt, culprit, scaled=trace.run.scaler)
            for i, layer in enumerate(trace.layers)]
    return sorted(rows, key=lambda r: (not r.culprit, r.nonfinite == 0, r.headroom, r.index))


# ----------------------------------------------------------------------------- steps


def ranked_warnings(trace: Trace) -> list[Finding]:
    return sorted(trace.warnings, key=lambda f: -f.score if math.isfinite(f.score) else -1e300)


@dataclass
class HiddenSteps:
    """A run of steps folded out of a timeline, and how many of them were notable."""

    count: int = 0
    skipped: int = 0
    nonfinite: int = 0
    first: int | None = None  # the first and last step index left out
    last: int | None = None

    def describe(self) -> str:
        extra = [
            f"{n} {what}"
            for n, what in ((self.nonfinite, "non-finite"), (self.skipped, "skipped"))
            if n
        ]
        text = f"{plural(self.count, 'step')} hidden"
        if self.first is not None and self.last is not None:
            # the range first ("steps" is in the text already): short enough for the note column
            extra.insert(0, f"{self.first}" if self.first == self.last
                         else f"{self.first}–{self.last}")
        return text + (f" ({', '.join(extra)})" if extra else "")


def fold_steps(
    trace: Trace, *, head: int = 3, tail: int = 3, notable: int = 24, show_all: bool = False
) -> list[StepRecord | HiddenSteps]:
    """Steps to show: the first and last few, the failing step and the skipped or non-finite ones.

    At most ``notable`` skipped or non-finite steps are kept (non-finite ones first, then in
    order); a :class:`HiddenSteps` stands for each run of steps left out.
    """
    fail_step = trace.first_failure.step if trace.first_failure else None
    return fold_step_list(
        trace.steps, fail_step, head=head, tail=tail, notable=notable, show_all=show_all
    )


def fold_step_list(
    steps: list[StepRecord],
    fail_step: int | None,
    *,
    head: int = 3,
    tail: int = 3,
    notable: int = 24,
    show_all: bool = False,
) -> list[StepRecord | HiddenSteps]:
    """:func:`fold_steps` on any list of steps (one rank's timeline) failing at ``fail_step``."""
    if show_all or len(steps) <= head + tail + 4:
        return list(steps)
    n = len(steps)
    keep = [i < head or i >= n - tail or s.index == fail_step for i, s in enumerate(steps)]
    candidates = [i for i, s in enumerate(steps) if s.nonfinite and not keep[i]]
    candidates += [i for i, s in enumerate(steps) if s.skipped and not s.nonfinite and not keep[i]]
    for i in candidates[: max(notable, 0)]:
        keep[i] = True
    out: list[StepRecord | HiddenSteps] = []
    hidden: HiddenSteps | None = None
    for s, k in zip(steps, keep, strict=True):
        if k:
            hidden = None
            out.append(s)
            continue
        if hidden is None:
            hidden = HiddenSteps()
            out.append(hidden)
        hidden.count += 1
        hidden.first = s.index if hidden.first is None else hidden.first
        hidden.last = s.index
        hidden.skipped += s.skipped
        hidden.nonfinite += s.nonfinite
    return out


def scaler_notes(trace: Trace) -> dict[int, str]:
    """Per step, what GradScaler did: ``backoff 65536→32768``."""
    notes: dict[int, list[str]] = {}
    for ev in trace.scaler_events:
        notes.setdefault(ev.step, []).append(f"{ev.event} → {fmt_scale_short(ev.scale_after)}")
    return {k: "; ".join(v) for k, v in notes.items()}


# ----------------------------------------------------------------------------- ranks


def rank_status(r: RankSummary) -> tuple[str, str]:
    """A rank's level (``ok``, ``warn``, ``bad``) and status in words: ``answered``, ``no
    answer``, ``crashed: RuntimeError: ...``, ``interrupted``."""
    if not r.answered:
        return "warn", "no answer"
    if r.status in ("crashed", "interrupted"):
        error = first_line(r.error, limit=120)
        return ("bad" if r.status == "crashed" else "warn"), (
            f"{r.status}: {error}" if error else r.status
        )
    if r.status == "running":
        return "warn", "answered (still running)"
    return "ok", "answered"


def rank_failure_text(ff: Failure | None) -> str:
    """``step 2 / data / model / input[0]``, or ``—``."""
    return ff.where() if ff is not None else "—"


def rank_order(trace: Trace) -> list[RankSummary]:
    """Ranks by interest for folding their timelines: the origin, other failing ranks, the rest
    (each group by rank)."""
    origin = trace.first_failure.rank if trace.first_failure else None
    return sorted(
        trace.ranks,
        key=lambda r: (r.rank != origin, r.first_failure is None, not r.answered, r.rank),
    )


def check_label(rec: Any) -> tuple[str, str]:
    """How a recommendation was checked, as shown everywhere: (label, level ok|warn|plain)."""
    if rec.verified:
        return "verified by re-run", "ok"
    if rec.check == "replay":
        return "checked by replaying the culprit", "warn"
    return "not verified", "plain"


def check_detail(rec: Any) -> str:
    """The verification text without the label it starts with (the label is shown apart)."""
    text = rec.verification or ""
    for prefix in ("verified by re-run: ", "checked by replaying the culprit: ",
                   "not verified: "):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def fix_options(rec: Any) -> str:
    """``--fix SPEC`` options that install the recommendation (quoted for a shell)."""
    import shlex

    return " ".join(f"--fix {shlex.quote(s)}" for s in rec.fix)


def try_line(i: int, t: Any) -> str:
    """One re-run of the search: what it installed and what it showed."""
    skipped = f", skipped {len(t.skipped)}" if t.skipped else ""
    return (f"re-run {i}: --fix {' --fix '.join(t.fixes)}: "
            f"{'trained' if t.verified else 'did not train'}: {t.reason}"
            + (f" ({t.seconds:g} s{skipped})" if t.seconds else ""))


def verification_lines(trace: Trace) -> list[str]:
    """Re-run verification for the whole report: its cost against the script's, its limits."""
    v = trace.verification
    if v is None:
        return []
    lines = []
    if v.tries:
        cost = f"{plural(v.tries, 're-run')} of {v.target_steps} steps at most, {v.seconds:g} s"
        if v.script_seconds:
            cost += (f" ({v.seconds / v.script_seconds:.1f}x the {v.script_seconds:g} s the "
                     "script took to reach the failure)")
        lines.append(cost)
    if v.note:
        lines.append(v.note)
    if v.redirected:
        lines.append("the re-runs' writes went to a scratch folder: " + "; ".join(v.redirected))
    elif v.tries:
        lines.append("re-runs ran with NANHUNT_RERUN=1 and WANDB_MODE=disabled; torch.save and "
                     "TensorBoard/Lightning/HF writers go to a scratch folder (none was used)")
    return lines


# ----------------------------------------------------------------------------- experiments

OUTCOME_TEXT = {"recurred": "failure recurred", "moved": "failure moved", "trained": "trained",
                "diverged": "diverged", "crashed": "crashed", "stopped": "stopped",
                "not run": "not run"}


def experiment_spec(e: Any) -> str:
    return " ".join(f"--fix {s}" for s in e.fixes) if e.fixes else "(no change)"


def experiment_rows(trace: Trace) -> list[tuple[str, str, str, str, str, str]]:
    """One row per re-run: (rung, spec, steps, outcome, detail, seconds)."""
    ex = trace.experiments
    if ex is None:
        return []
    return [(e.rung, experiment_spec(e), f"{e.steps}/{e.target_steps}",
             OUTCOME_TEXT.get(e.outcome, e.outcome), e.detail, f"{e.seconds:g} s")
            for e in ex.runs]


def _losses(values: list[float | None], n: int) -> str:
    return ", ".join("—" if v is None else f"{v:.4g}" for v in values[:n]) or "none"


def experiment_lines(trace: Trace) -> list[str]:
    """What the experiments showed, for the whole report (below the one line per rung)."""
    ex = trace.experiments
    if ex is None:
        return []
    lines = []
    if ex.verdict_text and ex.source == "experiments":
        lines.append(f"verdict: {ex.verdict_text}")
    if ex.contradiction:
        lines.append(ex.contradiction)
    control = next((e for e in ex.runs if e.rung == "control"), None)
    if control is not None and ex.failure_step is not None:
        n = ex.failure_step + 1
        if ex.control_reproduced is False:
            lines.append(f"losses to step {ex.failure_step}: original run "
                         f"{_losses([s.loss for s in trace.steps], n)}; control "
                         f"{_losses(control.losses, n)}")
        if ex.deterministic is not None:
            lines.append(
                f"the control's losses before step {ex.failure_step} "
                + ("equal the original run's bit for bit (deterministic)" if ex.deterministic
                   else f"differ from the original run's by up to {ex.spread:.3g} "
                   "(not deterministic)" if ex.spread is not None else
                   "differ from the original run's (not deterministic)"))
    if ex.not_run:
        lines.append("not run (the --budget was spent): " + "; ".join(ex.not_run))
    if ex.interrupted:
        lines.append("interrupted (Ctrl-C): what ran is kept")
    if (ex.source == "rules" and ex.note) or ex.note:
        lines.append(ex.note)
    if ex.runs:
        lines.append(f"{plural(len(ex.runs), 're-run')}, {ex.jobs} at a time, "
                     f"{ex.seconds:g} s (budget {ex.budget_seconds:g} s); horizon "
                     f"{ex.horizon} steps")
    return lines


def experiment_clause(trace: Trace) -> str:
    """What the headline says about the experiments: the one that proves the cause."""
    ex = trace.experiments
    if ex is None:
        return ""
    if ex.verdict == "not-reproduced":
        return " — the failure did not recur in an unfixed re-run: nothing verified"
    if ex.source == "rules" and ex.note and "--verify 0" not in ex.note:
        return " — the rules' verdict alone (no experiment ran)"
    text = ""
    if ex.source == "experiments" and ex.verdict_text and ex.verdict != "undetermined":
        text = " — " + ex.verdict_text
    fix = next((r for r in trace.recommendations if r.verified and r.fix), None)
    if fix is not None:
        text += ("; " if text else " — ") + f"--fix {' --fix '.join(fix.fix)} trains (verified)"
    return text
