"""The terminal report: rich output that reads at 80 columns and degrades to plain text.

Every user-supplied string (module names, messages, source lines) goes through
:class:`rich.text.Text`, never through console markup, so a ``[bold]`` in a module name prints as
written.
"""

from __future__ import annotations

import math

from rich import box
from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from nanhunt.formats import NumberFormat
from nanhunt.report import _curves, _precision
from nanhunt.report._common import (
    HiddenSteps,
    ModuleRow,
    bad_samples_text,
    check_detail,
    check_label,
    experiment_lines,
    experiment_rows,
    first_line,
    fix_options,
    fmt_binades,
    fmt_compact,
    fmt_num,
    fmt_pct,
    fmt_scale_short,
    fmt_value,
    fold_step_list,
    fold_steps,
    module_rows,
    plural,
    rank_failure_text,
    rank_order,
    rank_status,
    ranked_warnings,
    reduction_text,
    scaler_notes,
    shape_text,
    target_format,
    try_line,
    values_summary,
    verdict,
    verification_lines,
)
from nanhunt.trace import Failure, Finding, RankSummary, Recommendation, StepRecord, Trace

__all__ = ["render_terminal"]

_LEVEL_STYLE = {"bad": "bold red", "warn": "yellow", "ok": "green"}
_VERDICT_STYLE = {"problem": "bold red", "ok": "bold green", "partial": "bold yellow"}
_MAX_FACTS = 8
_MAX_WARNINGS = 8
_MAX_RANK_TIMELINES = 8


def render_terminal(
    trace: Trace, console: Console, *, show_all: bool = False, max_layers: int = 12
) -> None:
    """Print the report for ``trace`` on ``console``.

    ``show_all`` lists every module, step, warning and fact; otherwise long lists are folded
    (the module table to ``max_layers`` rows) with a line saying how many were left out.

    >>> import io
    >>> from rich.console import Console
    >>> from nanhunt.trace import Trace
    >>> out = io.StringIO()
    >>> render_terminal(Trace(), Console(file=out, width=80, color_system=None))
    >>> out.getvalue().splitlines()[1].strip("│ ")
    'the script exited before any training step'
    """
    fmt = target_format(trace)
    if _precision.is_audit(trace):
        console.print(_precision.audit_panel(trace))
    else:
        console.print(_verdict_panel(trace, fmt))
    if trace.first_failure is not None:
        _section(console, "First failure")
        console.print(_failure(trace.first_failure, fmt))
    if trace.diagnosis is not None:
        _section(console, "Diagnosis")
        console.print(_finding(trace.diagnosis, evidence=True))
    if experiment_rows(trace) or (trace.experiments is not None and
                                  "--verify 0" not in trace.experiments.note and
                                  experiment_lines(trace)):
        _section(console, "Experiments (re-runs that each change one thing)")
        _experiments(console, trace)
    if trace.warnings:
        _section(console, f"Warnings ({len(trace.warnings)})")
        _warnings(console, trace, show_all)
    if trace.layers:
        _section(console, f"Modules, worst first (headroom in binades below {fmt.name} max)")
        _modules(console, trace, fmt, show_all=show_all, max_layers=max_layers)
    if trace.steps:
        _section(console, "Timeline")
        console.print(_timeline(trace, show_all))
        curve = _curves.terminal_lines(trace)
        if curve:
            console.print()
            console.print(Text("\n".join(curve)), soft_wrap=True)
    if trace.precision is not None:
        _precision.terminal_section(console, trace, show_all=show_all, max_layers=max_layers)
    if trace.recommendations:
        _section(console, "Recommendations")
        shown: list[str] = []
        for i, rec in enumerate(trace.recommendations, 1):
            group, code = _recommendation(i, rec, shown)
            console.print(group)
            if code:
                # soft_wrap: code is never wrapped nor cropped, so that a pasted snippet is the
                # snippet; a line wider than the terminal overflows it
                console.print(_snippet(code), soft_wrap=True)
                console.print()
        if verification_lines(trace):
            console.print(_bullets(verification_lines(trace), indent=0, style="dim"))
    if trace.facts:
        _section(console, "Facts (non-finite values that were not failures)")
        _facts(console, trace, show_all)
    if len(trace.ranks) > 1:
        _section(console, f"Ranks ({len(trace.ranks)})")
        _ranks(console, trace, show_all)
    if trace.notes:
        _section(console, "Notes (limits of this report)")
        console.print(_bullets(trace.notes, indent=0, style="yellow"))


def _experiments(console: Console, trace: Trace) -> None:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column(overflow="fold")
    for rung, spec, steps, outcome, detail, seconds in experiment_rows(trace):
        style = "green" if outcome == "trained" else "red" if outcome in (
            "failure recurred", "failure moved", "diverged", "crashed") else "yellow"
        line = Text(f"{spec}: ")
        line.append(outcome, style=style)
        shown = detail.removeprefix("the failure recurred: ")
        line.append(f": {shown} ({steps} steps, {seconds})" if shown else
                    f" ({steps} steps, {seconds})")
        grid.add_row(rung, line)
    console.print(grid)
    lines = experiment_lines(trace)
    if lines:
        console.print(_bullets(lines, indent=0, style=""))


def _section(console: Console, title: str) -> None:
    console.print()
    console.rule(Text(title, style="bold"), align="left", style="dim")


def _verdict_panel(trace: Trace, fmt: NumberFormat) -> Panel:
    v = verdict(trace)
    body = Text()
    if v.partial:
        body.append(v.partial + "\n", style="bold yellow")
    body.append(v.headline, style=_VERDICT_STYLE[v.level])
    if v.note:
        body.append("\n" + v.note, style="bold")
    facts = _run_line(trace, fmt)
    if facts:
        body.append("\n" + facts, style="dim")
    if trace.run.status == "crashed" and trace.run.error:
        last = first_line(trace.run.error, limit=400)
        if last and last not in (v.partial or ""):
            body.append("\n" + last, style="red")
    return Panel(body, box=box.ROUNDED, expand=True, border_style=_VERDICT_STYLE[v.level])


def _run_line(trace: Trace, fmt: NumberFormat) -> str:
    run = trace.run
    parts = []
    if run.script:
        parts.append(run.script)
    if run.torch:
        parts.append(f"torch {run.torch}")
    if run.device:
        parts.append(run.device)
    if run.world_size > 1:
        parts.append(f"{run.world_size} ranks")
    mode = [m for m, on in (("autocast", run.autocast), ("GradScaler", run.scaler)) if on]
    parts.append(f"target {fmt.name}" + (f" ({', '.join(mode)})" if mode else ""))
    if trace.steps:
        parts.append(plural(len(trace.steps), "step"))
    return " · ".join(parts)


def _bullets(items: list[str], *, indent: int = 2, style: str = "", mark: str = "•") -> Padding:
    """A bulleted list whose wrapped lines hang under the text, not under the bullet."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    for item in items:
        grid.add_row(mark, Text(item, style=style))
    return Padding(grid, (0, 0, 0, indent))


def _kv_grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    return grid


def _failure(ff: Failure, fmt: NumberFormat) -> Table:
    grid = _kv_grid()
    grid.add_row("where", Text(ff.where()))
    if ff.rank is not None:
        grid.add_row("rank", Text(str(ff.rank)))
    if ff.source:
        grid.add_row("source", Text(ff.source, style="cyan"))
    if ff.source_line:
        grid.add_row("", Text("› " + ff.source_line.strip(), style="bold"))
    s = ff.stats
    shape = shape_text(s)
    grid.add_row("tensor", Text(f"{s.dtype} [{shape}], {s.numel:,} values"))
    grid.add_row("values", Text(", ".join(values_summary(s, fmt)), style="red"))
    grid.add_row("limit", Text(f"{fmt.name} max {fmt.max:g}"))
    reduced = reduction_text(ff)
    if reduced:
        grid.add_row("reduced", Text(reduced))
    if ff.detail:
        grid.add_row("detail", Text(ff.detail))
    for name, indices in ff.bad_samples.items():
        grid.add_row("samples", Text(f"{name}: {bad_samples_text(indices)}", style="red"))
    return grid


def _finding(f: Finding, *, evidence: bool) -> Group:
    head = Text()
    style = "bold red" if f.severity == "error" else "yellow"
    head.append(f.kind.replace("_", " "), style=style)
    head.append(f" ({f.rule})", style="dim")
    head.append(": ")
    head.append(f.message)
    parts: list[RenderableType] = [head]
    if evidence and f.evidence:
        parts.append(_bullets(f.evidence))
    return Group(*parts)


def _warnings(console: Console, trace: Trace, show_all: bool) -> None:
    warnings = ranked_warnings(trace)
    shown = warnings if show_all else warnings[:_MAX_WARNINGS]
    for w in shown:
        line = Text("▲ ", style="yellow")
        line.append(w.kind.replace("_", " "), style="yellow")
        if w.module:
            line.append(" · ")
            line.append(w.module, style="bold")
        line.append(f"  score {w.score:.2f}", style="dim")
        console.print(line)
        console.print(Padding(Text(w.message), (0, 0, 0, 2)))
        if show_all and w.evidence:
            console.print(_bullets(w.evidence, indent=4, style="dim"))
    _more(console, len(warnings) - len(shown), "warning")


def _more(console: Console, hidden: int, what: str) -> None:
    if hidden > 0:
        console.print(Text(f"… {plural(hidden, 'more ' + what)} (use --all)", style="dim"))


# the module table's numeric columns and their widths; "type" gets 9 to 14 columns
# (each as wide as its longest value: fmt_num 8, fmt_binades 5, fmt_pct 5, fmt_compact 5)
_NUMBER_COLUMNS = (("fwd\namax", 8), ("bwd\namax", 8), ("head-\nroom", 5),
                   ("under\nflow", 5), ("nan/\ninf", 5))  # fmt: skip
_SEPARATORS = 2 * (len(_NUMBER_COLUMNS) + 1)  # padding and divider after each column but the last


def _modules(
    console: Console, trace: Trace, fmt: NumberFormat, *, show_all: bool, max_layers: int
) -> None:
    rows = module_rows(trace, fmt)
    shown = rows if show_all else rows[: max(max_layers, 0)]
    numbers = sum(w for _, w in _NUMBER_COLUMNS)
    longest_name = max((len(r.module) + 2 * r.culprit for r in shown), default=0)
    type_width = min(max((len(r.type) for r in shown), default=4), 14)
    name_width = console.width - numbers - type_width - _SEPARATORS
    if name_width < longest_name and type_width > 9:
        # a short type column before folding module names
        type_width = 9
        name_width = console.width - numbers - type_width - _SEPARATORS
    fits = longest_name <= name_width
    table = Table(
        box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1, 0, 0), expand=not fits
    )
    table.add_column("module", overflow="fold", ratio=None if fits else 1)
    table.add_column("type", overflow="ellipsis", no_wrap=True, width=max(type_width, 4))
    for header, width in _NUMBER_COLUMNS:
        table.add_column(header, justify="right", no_wrap=True, width=width)
    for r in shown:
        table.add_row(*_module_cells(r, name_width), style="bold" if r.culprit else None)
    console.print(table)
    _more(console, len(rows) - len(shown), "module")
    if any(r.culprit for r in shown):
        console.print(Text("▶ first failure", style="dim"))


def _wrap_dotted(name: str, width: int, indent: str = "") -> str:
    """Break a qualified name after dots so that each line fits ``width``."""
    if len(name) <= width or width < 8:
        return name
    lines = [""]
    for part in name.replace(".", ".\0").split("\0"):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append(indent)
        lines[-1] += part
    return "\n".join(lines)


def _module_cells(r: ModuleRow, name_width: int) -> list[RenderableType]:
    style = _LEVEL_STYLE[r.level]
    name = Text("▶ ", style="bold red") if r.culprit else Text()
    prefix = "  " if r.culprit else ""
    name.append(_wrap_dotted(r.module or "(root)", name_width - len(prefix), prefix))
    return [
        name,
        Text(r.type, style="dim"),
        Text(fmt_num(r.fwd_amax)),
        Text(fmt_num(r.bwd_amax)),
        Text(fmt_binades(r.headroom), style=style),
        Text(fmt_pct(r.underflow), style="yellow" if r.underflow > 0.1 else ""),
        Text(fmt_compact(r.nonfinite), style="bold red" if r.nonfinite else "dim"),
    ]


def _timeline(trace: Trace, show_all: bool) -> Table:
    notes = scaler_notes(trace)
    fail_step = trace.first_failure.step if trace.first_failure else None
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1, 0, 0))
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("loss", justify="right", no_wrap=True)
    table.add_column("scale", justify="right", no_wrap=True)
    table.add_column("skipped", no_wrap=True)
    table.add_column("grad norm", justify="right", no_wrap=True)
    table.add_column("note", overflow="fold", ratio=1)
    for item in fold_steps(trace, show_all=show_all):
        if isinstance(item, HiddenSteps):
            # a mark in every column where its values sit, the text where notes start
            mark = Text("⋮", style="dim")
            table.add_row(mark, mark, mark, mark, mark, Text(item.describe(), style="dim"))
            continue
        s = item
        note = []
        if s.index == fail_step:
            note.append("first failure")
        elif s.nonfinite:
            note.append("non-finite")
        if s.index in notes:
            note.append(notes[s.index])
        bad = s.loss is not None and not math.isfinite(s.loss)
        table.add_row(
            str(s.index),
            Text(fmt_num(s.loss), style="bold red" if bad else ""),
            fmt_scale_short(s.scale) if s.scale is not None else "—",
            Text("skipped", style="yellow") if s.skipped else Text("·", style="dim"),
            fmt_num(s.grad_norm),
            Text(", ".join(note), style="red" if s.nonfinite else "dim"),
            style="bold" if s.index == fail_step else None,
        )
    return table


def _recommendation(i: int, rec: Recommendation, shown: list[str]) -> tuple[Group, str]:
    head = Text(f"{i}. ", style="bold")
    head.append(rec.type, style="bold cyan")
    value = fmt_value(rec.value)
    if rec.module:
        head.append(" · ")
        head.append(rec.module, style="bold")
    if value and value != rec.module:
        head.append(" · value ")
        head.append(value, style="bold")
    label, level = check_label(rec)
    style = {"ok": "bold green", "warn": "cyan", "plain": "yellow"}[level]
    check = Text(label, style=style)
    detail = check_detail(rec)
    if detail:
        check.append(": " + detail, style="")
    mark = Text("✓" if rec.verified else ("~" if level == "warn" else "✗"), style=style)
    status = Table.grid(padding=(0, 1))
    status.add_column(no_wrap=True)
    status.add_column(overflow="fold")
    status.add_row(mark, check)
    parts: list[RenderableType] = [head, Padding(status, (0, 0, 0, 3))]
    if rec.evidence:
        parts.append(_bullets(rec.evidence, indent=3, style="dim"))
    if len(rec.tries) > 1 or (rec.tries and not rec.verified):
        parts.append(_bullets([try_line(k, t) for k, t in enumerate(rec.tries, 1)], indent=3,
                              style="dim"))
    if rec.fix:
        parts.append(Padding(Text("nanhunt diagnose " + fix_options(rec) + " ...",
                                  style="bold"), (1, 0, 0, 3)))
    elif rec.code_change:
        parts.append(Padding(Text("needs a code change (no --fix installs it)", style="dim"),
                             (1, 0, 0, 3)))
    code = rec.snippet.rstrip("\n")
    if rec.helper and rec.helper not in shown:
        shown.append(rec.helper)
        code = rec.helper.rstrip("\n") + "\n\n\n" + code
    elif rec.helper:
        code = f"# uses {_helper_name(rec.helper)}, shown above\n" + code
    parts.append(Text())  # the code, if any, follows: printed by the caller (see _snippet)
    return Group(*parts), code


def _helper_name(helper: str) -> str:
    for line in helper.splitlines():
        if line.startswith("def "):
            return line[4:].split("(")[0] + "()"
    return "the helper"


def _snippet(snippet: str, indent: str = "   ") -> Text:
    """The code highlighted, each line indented, for printing with ``soft_wrap=True``."""
    code = snippet.rstrip("\n")
    text = Syntax(code, "python", theme="ansi_dark", background_color="default").highlight(code)
    text.rstrip()
    lines = text.split("\n", allow_blank=True)
    return Text("\n").join(Text.assemble(indent, line) if line.plain else line for line in lines)


def _facts(console: Console, trace: Trace, show_all: bool) -> None:
    shown = trace.facts if show_all else trace.facts[:_MAX_FACTS]
    console.print(_bullets(shown, indent=0))
    _more(console, len(trace.facts) - len(shown), "fact")


def _ranks(console: Console, trace: Trace, show_all: bool) -> None:
    origin = trace.first_failure.rank if trace.first_failure else None
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1, 0, 0))
    table.add_column("rank", justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("steps", justify="right", no_wrap=True)
    table.add_column("skipped", justify="right", no_wrap=True)
    table.add_column("first failure", overflow="fold", min_width=16)
    errors: list[str] = []  # under the table, where they have the whole width
    for r in trace.ranks:
        level, status = rank_status(r)
        status, _, error = status.partition(": ")
        if error:
            errors.append(f"rank {r.rank} {status}: {error}")
        mark = "▶ " if r.rank == origin else ""
        counts = (
            (str(len(r.steps)), str(sum(s.skipped for s in r.steps))) if r.answered else ("—",) * 2
        )
        table.add_row(
            Text(f"{mark}{r.rank}", style="bold red" if mark else ""),
            Text(status, style=_LEVEL_STYLE[level]),
            *counts,
            Text(rank_failure_text(r.first_failure), style="red" if r.first_failure else "dim"),
            style="bold" if mark else None,
        )
    console.print(table)
    if errors:
        console.print(_bullets(errors, indent=0, style="red"))
    if origin is not None:
        console.print(
            Text("▶ origin (first to fail): the sections above show its trace", style="dim")
        )
    timelines = [r for r in rank_order(trace) if r.steps]
    shown = timelines if show_all else timelines[:_MAX_RANK_TIMELINES]
    for r in sorted(shown, key=lambda r: r.rank):
        console.print()
        console.print(_rank_heading(r))
        console.print(Padding(_rank_timeline(r.steps, r.first_failure, show_all), (0, 0, 0, 2)))
    _more(console, len(timelines) - len(shown), "rank timeline")


def _rank_heading(r: RankSummary) -> Text:
    line = Text(f"rank {r.rank}", style="bold")
    line.append(f" · {plural(len(r.steps), 'step')}", style="dim")
    if r.first_failure is not None:
        line.append(f" · first failure at step {r.first_failure.step}", style="red")
    else:
        line.append(" · no non-finite values", style="green")
    if r.status in ("crashed", "interrupted"):
        line.append(f" · {r.status}", style=_LEVEL_STYLE[rank_status(r)[0]])
    return line


def _rank_timeline(steps: list[StepRecord], ff: Failure | None, show_all: bool) -> Table:
    """One rank's steps, folded harder than the main timeline: 2 first, 2 last, 4 notable."""
    fail_step = ff.step if ff is not None else None
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1, 0, 0))
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("loss", justify="right", no_wrap=True)
    table.add_column("scale", justify="right", no_wrap=True)
    table.add_column("skipped", no_wrap=True)
    table.add_column("grad norm", justify="right", no_wrap=True)
    table.add_column("note", overflow="fold")
    items = fold_step_list(steps, fail_step, head=2, tail=2, notable=4, show_all=show_all)
    for item in items:
        if isinstance(item, HiddenSteps):
            # a mark in every column where its values sit, the text where notes start
            mark = Text("⋮", style="dim")
            table.add_row(mark, mark, mark, mark, mark, Text(item.describe(), style="dim"))
            continue
        s = item
        note = "first failure" if s.index == fail_step else ("non-finite" if s.nonfinite else "")
        bad = s.loss is not None and not math.isfinite(s.loss)
        table.add_row(
            str(s.index),
            Text(fmt_num(s.loss), style="bold red" if bad else ""),
            fmt_scale_short(s.scale) if s.scale is not None else "—",
            Text("skipped", style="yellow") if s.skipped else Text("·", style="dim"),
            fmt_num(s.grad_norm),
            Text(note, style="red" if s.nonfinite or note else "dim"),
            style="bold" if s.index == fail_step else None,
        )
    return table
