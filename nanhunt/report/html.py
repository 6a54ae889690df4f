"""The HTML report: one self-contained page (inline CSS, JS and SVG) that opens from disk.

The page carries the whole trace as JSON in ``<script type="application/json"
id="nanhunt-data">``, with ``<``, ``>`` and ``&`` escaped as ``\\u003c`` etc. so that no string
from user code (module names, source lines, error messages) can close the script element. Every
user string in the markup goes through :func:`html.escape`. Charts are drawn here, in Python, as
inline SVG; the small script only adds copy buttons, table sorting and a JSON download.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from nanhunt._version import __version__
from nanhunt.formats import NumberFormat
from nanhunt.report import _curves, _precision, _svg
from nanhunt.report._common import (
    HiddenSteps,
    bad_samples_text,
    check_detail,
    check_label,
    experiment_lines,
    experiment_rows,
    fix_options,
    fmt_binades,
    fmt_compact,
    fmt_count,
    fmt_num,
    fmt_pct,
    fmt_scale,
    fmt_value,
    fold_step_list,
    has_problem,
    module_rows,
    plural,
    rank_status,
    ranked_warnings,
    reduction_text,
    scaler_notes,
    shape_text,
    target_format,
    try_line,
    verdict,
    verification_lines,
)
from nanhunt.report._svg import esc
from nanhunt.trace import Failure, Finding, OpRecord, RankSummary, Recommendation, StepRecord, Trace

__all__ = ["render_html"]


def render_html(trace: Trace) -> str:
    """The report as one HTML page with no external resources.

    >>> from nanhunt.trace import Trace
    >>> page = render_html(Trace())
    >>> page.startswith("<!doctype html>") and 'id="nanhunt-data"' in page
    True
    """
    fmt = target_format(trace)
    v = verdict(trace)
    title = f"nanhunt · {v.headline}"
    if trace.run.script:
        title += f" · {trace.run.script}"
    body = [
        _header(trace),
        '<main class="page">',
        _precision.html_verdict(trace) if _precision.is_audit(trace) else _verdict(trace, fmt),
        _nav(trace),
    ]
    if trace.first_failure is not None or trace.diagnosis is not None:
        body.append('<div class="two-col">')
        if trace.first_failure is not None:
            body.append(_failure(trace.first_failure, fmt))
        if trace.diagnosis is not None:
            # the verdict's lede already says the diagnosis' message: the card does not repeat it
            body.append(_diagnosis(trace.diagnosis, message=False))
        body.append("</div>")
    if not _precision.is_audit(trace):
        body.append(_ranges(trace, fmt))
    if trace.precision is not None:
        body.append(_precision.html_card(trace))
    if experiment_rows(trace):
        body.append(_experiments(trace))
    if trace.recommendations:
        body.append(_recommendations(trace.recommendations, verification_lines(trace)))
    if trace.steps:
        body.append(_timeline(trace, fmt))
    if trace.first_failure is not None and _has_histogram(trace):
        body.append(_histogram(trace.first_failure, fmt))
    if trace.grad_hist:
        body.append(_grad_histograms(trace, fmt))
    if trace.layers:
        body.append(_modules(trace, fmt))
    if trace.warnings:
        body.append(_warnings(trace))
    if trace.facts:
        body.append(_facts(trace.facts))
    if trace.ops:
        body.append(_ops(trace.ops))
    if trace.ranks:
        body.append(_ranks(trace))
    if trace.notes:
        body.append(_notes(trace.notes))
    body.append(_run_facts(trace, fmt))
    body.append(_footer(trace))
    body.append("</main>")
    return (
        "<!doctype html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<meta name="generator" content="nanhunt">\n'
        f"<title>{esc(title)}</title>\n"
        f"<style>{_CSS}{_code_css()}</style>\n</head>\n"
        f'<body class="verdict-{v.level}">\n'
        + "\n".join(body)
        + "\n"
        + _data_island(trace)
        + f"\n<script>{_JS}</script>\n</body>\n</html>\n"
    )


def _has_histogram(trace: Trace) -> bool:
    ff = trace.first_failure
    return ff is not None and bool(ff.stats.hist or ff.stats.nonfinite)


def _data_island(trace: Trace) -> str:
    data = (
        trace.to_json(indent=None)
        .replace("&", "\\u0026")
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )
    return f'<script type="application/json" id="nanhunt-data">{data}</script>'


# ----------------------------------------------------------------------------- sections


def _card(id_: str, title: str, inner: str, *, sub: str = "", cls: str = "") -> str:
    sub_html = f'<p class="sub">{sub}</p>' if sub else ""
    return (
        f'<section id="{id_}" class="card {cls}"><h2>{esc(title)}</h2>{sub_html}{inner}</section>'
    )


def _header(trace: Trace) -> str:
    run = trace.run
    meta = [esc(run.script)] if run.script else []
    if run.started:
        meta.append(esc(run.started.replace("T", " ").replace("Z", " UTC")))
    return (
        '<header class="topbar"><div class="topbar-inner">'
        '<span class="brand"><span class="logo" aria-hidden="true">◆</span>nanhunt</span>'
        f'<span class="topmeta">{" · ".join(meta)}</span></div></header>'
    )


def _verdict(trace: Trace, fmt: NumberFormat) -> str:
    v = verdict(trace)
    partial = f'<p class="partial">{esc(v.partial)}</p>' if v.partial else ""
    note = f'<p class="exit-note">{esc(v.note)}</p>' if v.note else ""
    lede = ""
    if trace.diagnosis is not None:
        lede = f'<p class="lede">{esc(trace.diagnosis.message)}</p>'
    elif not (trace.layers or trace.steps):
        lede = '<p class="lede">No steps or module statistics were recorded.</p>'
    elif not has_problem(trace):
        skip = " or was an expected GradScaler skip" if trace.facts else ""
        lede = (
            f'<p class="lede">Every recorded value stayed inside {esc(fmt.name)}\'s range '
            f"(max {fmt.max:g}){skip}.</p>"
        )
    chips = []
    if trace.steps:
        chips.append(plural(len(trace.steps), "step"))
        skipped = sum(s.skipped for s in trace.steps)
        if skipped:
            chips.append(f"{skipped} skipped")
    if trace.layers:
        chips.append(plural(len(trace.layers), "module"))
    chips.append(f"target {fmt.name}")
    mode = [
        m for m, on in (("autocast", trace.run.autocast), ("GradScaler", trace.run.scaler)) if on
    ]
    if mode:
        chips.append(" + ".join(mode))
    if trace.run.device:
        chips.append(trace.run.device)
    if trace.run.world_size > 1:
        chips.append(plural(trace.run.world_size, "rank"))
    if trace.recommendations:
        verified = sum(r.verified for r in trace.recommendations)
        chips.append(f"{plural(len(trace.recommendations), 'fix', 'fixes')}, {verified} "
                     "verified by re-run")
    chip_html = "".join(f'<span class="chip">{esc(c)}</span>' for c in chips)
    return (
        f'<section id="verdict" class="verdict {v.level}" data-level="{v.level}">'
        f"{partial}<h1>{_breakable(esc(v.headline))}</h1>{note}{lede}"
        f'<div class="chips">{chip_html}</div></section>'
    )


_NAME_DOT = re.compile(r"(?<=[A-Za-z0-9_\]])\.(?=[A-Za-z_]|\d+\.)")


def _breakable(text: str) -> str:
    """Escaped text whose dotted names (``encoder.blocks.1.ffn.wo``) may break after a dot, not
    mid-name, in a narrow window (numbers such as ``6.55e+04`` keep their dot)."""
    return _NAME_DOT.sub(".<wbr>", text)


def _nav(trace: Trace) -> str:
    links = []
    if trace.first_failure is not None:
        links.append(("failure", "First failure"))
    if trace.diagnosis is not None:
        links.append(("diagnosis", "Diagnosis"))
    if not _precision.is_audit(trace):
        links.append(("ranges", "Ranges"))
    if trace.precision is not None:
        links.append(("precision", "Precision"))
    for cond, id_, label in (
        (experiment_rows(trace), "experiments", "Experiments"),
        (trace.recommendations, "recommendations", "Fixes"),
        (trace.steps, "timeline", "Timeline"),
        (
            trace.first_failure is not None and trace.first_failure.stats.hist,
            "histogram",
            "Exponents",
        ),
        (trace.layers, "modules", "Modules"),
        (trace.warnings, "warnings", "Warnings"),
        (trace.facts, "facts", "Facts"),
        (trace.ops, "ops", "Op replay"),
        (trace.ranks, "ranks", "Ranks"),
        (trace.notes, "notes", "Notes"),
    ):
        if cond:
            links.append((id_, label))
    links.append(("run", "Run"))
    items = "".join(f'<a href="#{id_}">{esc(label)}</a>' for id_, label in links)
    return f'<nav class="toc">{items}</nav>'


def _run_facts(trace: Trace, fmt: NumberFormat) -> str:
    run = trace.run
    rows: list[tuple[str, str]] = []

    def add(label: str, value: object, *, mono: bool = False) -> None:
        if value in (None, "", []):
            return
        text = esc(value)
        rows.append((label, f"<code>{text}</code>" if mono else text))

    add("script", run.script, mono=True)
    add("command", " ".join(run.command), mono=True)
    status = run.status + (f" (exit code {run.exit_code})" if run.exit_code is not None else "")
    add("status", status)
    add("device", run.device)
    add("target", fmt.name + (f" (recorded as {run.target})" if run.target != fmt.name else ""))
    add("dtypes seen", ", ".join(run.dtypes))
    add("autocast", "on" if run.autocast else "off")
    add("GradScaler", "on" if run.scaler else "off")
    if run.world_size > 1:
        add("world size", run.world_size)
    add("torch", run.torch)
    add("python", run.python)
    add("platform", run.platform)
    add("nanhunt", run.nanhunt)
    add("started", run.started)
    add("finished", run.finished)
    add("snapshot", trace.snapshot, mono=True)
    grid = "".join(f"<dt>{esc(k)}</dt><dd>{v}</dd>" for k, v in rows)
    error = ""
    if run.error:
        error = f'<h3>Error</h3><pre class="error">{esc(run.error)}</pre>'
    return _card("run", "Run", f'<dl class="facts-grid">{grid}</dl>{error}')


def _failure(ff: Failure, fmt: NumberFormat) -> str:
    where = [
        ("step", str(ff.step)),
        ("phase", ff.phase),
        ("module", ff.module),
        ("tensor", ff.tensor),
        ("op", ff.op or ""),
    ]
    if ff.rank is not None:
        where.append(("rank", str(ff.rank)))
    cells = "".join(
        f'<div class="kv"><span class="k">{esc(k)}</span><span class="v mono">{esc(v)}</span></div>'
        for k, v in where
        if v
    )
    source = ""
    if ff.source or ff.source_line:
        loc = f'<div class="src-loc mono">{esc(ff.source or "")}</div>' if ff.source else ""
        line = ""
        if ff.source_line:
            line = f'<pre class="src-line"><code>{_highlight(ff.source_line.strip())}</code></pre>'
        source = f'<div class="source">{loc}{line}</div>'
    s = ff.stats
    shape = shape_text(s)
    stats = [
        ("amax", fmt_num(s.amax), ""),
        ("+inf", fmt_count(s.posinf), "bad" if s.posinf else ""),
        ("-inf", fmt_count(s.neginf), "bad" if s.neginf else ""),
        ("nan", fmt_count(s.nan), "bad" if s.nan else ""),
    ]
    if not s.nonfinite:
        stats.append(("headroom", fmt_binades(fmt.headroom_binades(s.amax)) + " binades", ""))
    # counted apart: exact zeros, subnormal values, values below the smallest subnormal
    stats.append(("exact zeros", fmt_count(s.zero), ""))
    stats.append(("subnormal", fmt_count(s.underflow - s.flushed),
                  "warn" if s.underflow - s.flushed else ""))
    if s.flushed:
        stats.append(("would flush", fmt_count(s.flushed), "warn"))
    stat_html = "".join(
        f'<div class="stat {c}"><span class="stat-v">{esc(v)}</span>'
        f'<span class="stat-k">{esc(k)}</span></div>'
        for k, v, c in stats
    )
    detail = f'<p class="detail">{esc(ff.detail)}</p>' if ff.detail else ""
    reduced = reduction_text(ff)
    if reduced:
        detail = f'<p class="detail">Reduced across ranks: {esc(reduced)}</p>' + detail
    if ff.bad_samples:
        samples = "; ".join(f"{k}: {bad_samples_text(v)}" for k, v in ff.bad_samples.items())
        detail += f'<p class="detail">Samples with non-finite values: {esc(samples)}</p>'
    over = f", {fmt_count(s.overflow)} finite values over the max" if s.overflow else ""
    inner = (
        f'<div class="kv-row">{cells}</div>{source}'
        f'<div class="stats">{stat_html}</div>'
        f'<p class="muted small">{esc(s.dtype)} [{esc(shape)}], {s.numel:,} values{over}; '
        f"{esc(fmt.name)} max {fmt.max:g}</p>{detail}"
    )
    return _card("failure", "First failure", inner, cls="failure-card")


def _diagnosis(f: Finding, *, message: bool = True) -> str:
    sev = "bad" if f.severity == "error" else "warn"
    head = (
        f'<div class="badges"><span class="badge {sev}">{esc(f.kind.replace("_", " "))}</span>'
        f'<span class="badge plain mono">{esc(f.rule)}</span></div>'
    )
    evidence = _list(f.evidence, "evidence")
    text = f'<p class="message">{esc(f.message)}</p>' if message else ""
    return _card("diagnosis", "Diagnosis", f"{head}{text}{evidence}")


def _list(items: Sequence[str], cls: str) -> str:
    if not items:
        return ""
    return f'<ul class="{cls}">' + "".join(f"<li>{esc(i)}</li>" for i in items) + "</ul>"


def _ranges(trace: Trace, fmt: NumberFormat) -> str:
    title = f"Where values leave {fmt.name}'s range"
    if not trace.layers:
        return _card("ranges", title, '<p class="empty">No module statistics were recorded.</p>')
    culprit = trace.first_failure.module if trace.first_failure else None
    if not culprit and trace.diagnosis is not None:
        culprit = trace.diagnosis.module
    legend = (
        '<div class="legend">'
        f'<span><i class="sw" style="background:{_svg.FWD}"></i>forward (module output)</span>'
        f'<span><i class="sw" style="background:{_svg.BWD}"></i>backward (gradient of the '
        "output, loss-scaled)</span>"
        '<span><i class="sw zone-sub"></i>subnormal: precision lost</span>'
        '<span><i class="sw zone-flush"></i>flushed to zero</span>'
        '<span><i class="sw zone-over"></i>overflow to inf</span>'
        f'<span><i class="dia"></i>non-finite values</span></div>'
    )
    name = esc(fmt.name)
    sub = (
        "One row per module in execution order; each bar spans its smallest to largest non-zero "
        f"magnitude on a log<sub>2</sub> axis. Right of the red line values overflow {name} to "
        "inf; in the amber zone they lose precision; in the hatched zone they flush to zero."
    )
    chart = _svg.range_chart(trace.layers, fmt, culprit, failure=trace.first_failure)
    return _card("ranges", title, f'{legend}<div class="chart-wrap">{chart}</div>', sub=sub)


def _timeline(trace: Trace, fmt: NumberFormat) -> str:
    steps = trace.steps
    skipped = [s.index for s in steps if s.skipped]
    fail = trace.first_failure.step if trace.first_failure else None
    # a failure without a NaN: the line marks the step the finding names (a spike, the onset
    # of a divergence), and the culprit's signal is drawn on the same axis of steps
    curve = _curves.curve_view(trace) if fail is None else None
    if curve is not None:
        fail = curve.step
    common = {"skipped": skipped, "fail_step": fail}
    figs = [
        (
            "Loss",
            _svg.line_chart(_svg.Series([(s.index, s.loss) for s in steps]), **common),
        ),
        (
            "Loss scale",
            _svg.line_chart(
                _svg.Series([(s.index, s.scale) for s in steps], colour="#7c3aed", step=True),
                log="2",
                **common,
            )
            if trace.run.scaler or any(s.scale is not None for s in steps)
            else _svg.empty_chart("No GradScaler in this run: there is no loss scale"),
        ),
    ]
    norms = [s.grad_norm for s in steps if s.grad_norm is not None and math.isfinite(s.grad_norm)]
    log = "10" if norms and min(norms) > 0 and max(norms) / min(norms) > 100 else ""
    figs.append(
        (
            "Gradient norm (unscaled)",
            _svg.line_chart(
                _svg.Series([(s.index, s.grad_norm) for s in steps], colour="#0d9488"),
                log=log,
                **common,
            ),
        )
    )
    culprit = trace.first_failure.module if trace.first_failure else None
    layer = next((ly for ly in trace.layers if culprit and ly.module == culprit), None)
    if layer is not None and layer.forward_amax_by_step:
        pts = sorted(layer.forward_amax_by_step.items())
        figs.append(
            (
                f"Forward amax of {culprit}",
                _svg.line_chart(
                    _svg.Series(pts, colour=_svg.BAD),
                    log="2",
                    limit=(fmt.max, f"{fmt.name} max"),
                    **common,
                ),
            )
        )
    if curve is not None and len(curve.points) >= 2:
        figs.append((curve.signal[0].upper() + curve.signal[1:], _svg.line_chart(
            _svg.Series(curve.points, colour=_svg.BAD), log="10", **common)))
    for group, pts in (curve.groups.items() if curve is not None else ()):
        if len(pts) >= 2:
            figs.append((f"Update-to-weight ratio of {group}", _svg.line_chart(
                _svg.Series(pts, colour="#7c3aed"), log="10", **common)))
    fig_html = "".join(
        f'<figure class="mini"><figcaption>{esc(t)}</figcaption>{svg}</figure>' for t, svg in figs
    )
    legend = (
        '<div class="legend"><span><i class="sw" style="background:#fde68a"></i>'
        "step skipped by GradScaler</span>"
        + ('<span><i class="vline"></i>the step the finding names</span>' if curve is not None
           else '<span><i class="vline"></i>first failure</span>')
        + '<span><i class="cross">×</i>non-finite value</span></div>'
    )
    table = _steps_table(trace)
    return _card(
        "timeline",
        "Timeline",
        f'{legend}<div class="mini-grid">{fig_html}</div>{table}',
    )


def _steps_table(trace: Trace) -> str:
    fail = trace.first_failure.step if trace.first_failure else None
    n = len(trace.steps)
    table, shown = _step_rows(trace.steps, fail, scaler_notes(trace))
    if n <= 12:
        return f'<details class="steps" open><summary>Steps</summary>{table}</details>'
    summary = f"All {n} steps" if shown == n else f"{shown} of {n} steps (the rest are in the JSON)"
    return f'<details class="steps"><summary>{esc(summary)}</summary>{table}</details>'


def _step_rows(steps: list[StepRecord], fail: int | None, notes: dict[int, str]) -> tuple[str, int]:
    """A step table (folded past 60 steps) and how many steps it shows."""
    items = fold_step_list(steps, fail, head=10, tail=10, notable=100, show_all=len(steps) <= 60)
    rows = []
    for s in items:
        if isinstance(s, HiddenSteps):
            rows.append(f'<tr class="gap"><td class="num">…</td><td colspan="5">'
                        f"{esc(s.describe())}</td></tr>")  # fmt: skip
            continue
        cls = "culprit" if s.index == fail else ("bad" if s.nonfinite else "")
        note = []
        if s.index == fail:
            note.append("first failure")
        elif s.nonfinite:
            note.append("non-finite")
        if s.index in notes:
            note.append(notes[s.index])
        skip = '<span class="badge warn">skipped</span>' if s.skipped else ""
        rows.append(
            f'<tr class="{cls}"><td class="num">{s.index}</td>'
            f'<td class="num">{esc(fmt_num(s.loss))}</td>'
            f'<td class="num">{esc(fmt_scale(s.scale))}</td>'
            f"<td>{skip}</td>"
            f'<td class="num">{esc(fmt_num(s.grad_norm))}</td>'
            f"<td>{esc(', '.join(note))}</td></tr>"
        )
    table = (
        '<table class="data"><thead><tr><th class="num">step</th><th class="num">loss</th>'
        '<th class="num">scale</th><th>skipped</th><th class="num">grad norm</th><th>note</th>'
        f"</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )
    return table, sum(not isinstance(s, HiddenSteps) for s in items)


def _histogram(ff: Failure, fmt: NumberFormat) -> str:
    sub = (
        f"Count of values per binade [2<sup>e</sup>, 2<sup>e+1</sup>) in "
        f"<code>{esc(ff.module or ff.tensor)}</code>'s {esc(ff.tensor)} at step {ff.step} "
        "(log count axis)."
    )
    chart = _svg.histogram_chart(
        ff.stats.hist,
        fmt,
        nonfinite=ff.stats.nonfinite,
        nonfinite_title=_svg.nonfinite_text(ff.stats),
    )
    return _card(
        "histogram",
        "Exponent histogram of the first failure",
        f'<div class="chart-wrap">{chart}</div>',
        sub=sub,
    )


def _grad_histograms(trace: Trace, fmt: NumberFormat) -> str:
    scales = [s.scale for s in trace.steps if s.scale is not None and s.scale > 0]
    shift = round(math.log2(scales[0])) if scales and math.isfinite(scales[0]) else None
    charts = []
    for dtype, hist in sorted(trace.grad_hist.items()):
        label = f"× loss scale 2{_svg.superscript(shift)}" if shift is not None else ""
        chart = _svg.histogram_chart(hist, fmt, shift=shift, shift_label=label)
        charts.append(
            f'<figure class="wide"><figcaption>{esc(dtype)} gradients</figcaption>'
            f'<div class="chart-wrap">{chart}</div></figure>'
        )
    sub = (
        "Parameter gradients before loss scaling, per binade (log count axis), against "
        f"{esc(fmt.name)}'s limits."
    )
    if shift is not None:
        sub += (
            f" The purple outline is the same gradients multiplied by the first recorded loss "
            f"scale (2<sup>{shift}</sup>): what the scaler must fit into the range."
        )
    return _card("gradients", "Gradient exponents", "".join(charts), sub=sub)


_EXPERIMENT_COLOURS = {"original run": "#64748b", "control": "#0f172a",
                       "fp32": "#2563eb", "fix": "#16a34a"}


def _experiments(trace: Trace) -> str:
    """The experiment ladder: a table of the re-runs and the loss curves of the original run,
    the control, the float32 experiment and the fix on one chart."""
    ex = trace.experiments
    assert ex is not None
    rows = "".join(
        f'<tr class="outcome-{esc(outcome.replace(" ", "-"))}"><td>{esc(rung)}</td>'
        f"<td><code>{esc(spec)}</code></td><td class=\"num\">{esc(steps)}</td>"
        f"<td>{esc(outcome)}</td><td>{esc(detail)}</td><td class=\"num\">{esc(sec)}</td></tr>"
        for rung, spec, steps, outcome, detail, sec in experiment_rows(trace))
    table = ('<div class="table-wrap"><table class="data experiments"><thead><tr>'
             "<th>rung</th><th>change</th><th class=\"num\">steps</th><th>outcome</th>"
             f"<th>what it showed</th><th class=\"num\">time</th></tr></thead><tbody>{rows}"
             "</tbody></table></div>")
    fixes = [e for e in ex.runs if e.rung == "fix"]
    # the verified fix's re-run (the region bisection's, a rung's or the fix search's)
    verified = next((r.fix for r in trace.recommendations if r.verified and r.fix), None)
    fix = next((e for e in ex.runs if verified and e.fixes == verified and e.losses), None) or \
        next((e for e in fixes if e.outcome == "trained"), fixes[-1] if fixes else None)
    curves = [("original run", [(s.index, s.loss) for s in trace.steps])]
    for label, e in (("control", next((e for e in ex.runs if e.rung == "control"), None)),
                     ("fp32", next((e for e in ex.runs if e.rung == "fp32"), None)),
                     ("fix", fix)):
        if e is not None and e.losses:
            name = label if label != "fix" else "fix: " + " ".join(e.fixes)
            curves.append((name, list(enumerate(e.losses))))
    series = [(label, _svg.Series(pts, colour=_EXPERIMENT_COLOURS.get(label.split(":")[0],
                                                                     "#16a34a")))
              for label, pts in curves if pts]
    chart = ""
    if series:
        legend = "".join(
            f'<span><i class="sw" style="background:{s.colour}"></i>{esc(label)}</span>'
            for label, s in series)
        svg = _svg.multi_line_chart(series, fail_step=ex.failure_step)
        chart = ('<figure class="wide experiment-loss"><figcaption>Loss: the original run, '
                 "the control, float32 everywhere and the fix</figcaption>"
                 f'<div class="legend">{legend}<span><i class="vline"></i>first failure</span>'
                 '<span><i class="cross">×</i>non-finite loss</span></div>'
                 f'<div class="chart-wrap">{svg}</div></figure>')
    sub = ("Each row is the script run again with one change (the control: none) to the "
           f"horizon of {ex.horizon} steps; the verdict is read from their outcomes.")
    return _card("experiments", "Experiments", table + chart +
                 _list(experiment_lines(trace), "facts"), sub=sub)


def _notes(notes: Sequence[str]) -> str:
    return _card(
        "notes",
        "Notes",
        _list(notes, "facts"),
        sub="Limits of this report: stages that failed or could not be checked.",
    )


def _code_block(code: str, label: str = "copy snippet") -> str:
    return (
        '<div class="snippet"><button type="button" class="copy needs-js" '
        f'aria-label="{esc(label)}">Copy</button><pre class="code"><code>'
        f"{_highlight(code.rstrip())}</code></pre></div>"
    )


def _recommendations(recs: Sequence[Recommendation], notes: Sequence[str] = ()) -> str:
    cards = []
    helpers: list[str] = []
    for i, r in enumerate(recs, 1):
        value = fmt_value(r.value)
        module = f'<code class="module">{esc(r.module)}</code>' if r.module else ""
        value_html = (
            f'<span class="value">value <code>{esc(value)}</code></span>'
            if value and value != r.module
            else ""
        )
        label, level = check_label(r)
        mark = "✓" if r.verified else ("~" if level == "warn" else "✗")
        check = f'<span class="badge {level}">{mark} {esc(label)}</span>'
        verification = f'<span class="verification">{esc(check_detail(r))}</span>'
        fix = ""
        if r.fix:
            fix = (f'<p class="fix">install it without editing the script: '
                   f"<code>nanhunt diagnose {esc(fix_options(r))} …</code></p>")
        elif r.code_change:
            fix = '<p class="fix">needs a code change (no --fix installs it)</p>'
        tries = _list([try_line(k, t) for k, t in enumerate(r.tries, 1)], "evidence") \
            if len(r.tries) > 1 or (r.tries and not r.verified) else ""
        helper = ""
        if r.helper and r.helper not in helpers:
            helpers.append(r.helper)
            helper = '<p class="fix">helper (paste once):</p>' + _code_block(r.helper,
                                                                          "copy helper")
        snippet = _code_block(r.snippet) if r.snippet else ""
        cards.append(
            f'<article class="rec{" verified" if r.verified else ""}">'
            f'<header><span class="num-badge">{i}</span>'
            f'<span class="badge type mono">{esc(r.type)}</span>{module}{value_html}</header>'
            f'<div class="check">{check}{verification}</div>'
            f"{_list(r.evidence, 'evidence')}{tries}{fix}{helper}{snippet}</article>"
        )
    if notes:
        cards.append(_list(list(notes), "facts"))
    return _card("recommendations", "Recommendations", "".join(cards))


def _modules(trace: Trace, fmt: NumberFormat) -> str:
    rows = []
    for r in module_rows(trace, fmt):
        cls = " ".join(c for c in ("culprit" if r.culprit else "", r.level) if c)
        head = r.headroom if math.isfinite(r.headroom) else (-1e9 if r.headroom < 0 else 1e9)
        rows.append(
            f'<tr class="{cls}" data-order="{r.index}">'
            f'<td class="mono" data-v="{esc(r.module)}">{"▶ " if r.culprit else ""}'
            f"{_breakable(esc(r.module or '(root)'))}</td>"
            f'<td class="muted">{esc(r.type)}</td>'
            f'<td class="num" data-v="{_sortnum(r.fwd_amax)}">{esc(fmt_num(r.fwd_amax))}</td>'
            f'<td class="num" data-v="{_sortnum(r.bwd_amax)}">{esc(fmt_num(r.bwd_amax))}</td>'
            f'<td class="num head {r.level}" data-v="{head:.4g}">'
            f"{esc(fmt_binades(r.headroom))}</td>"
            f'<td class="num" data-v="{r.underflow:.6g}">{esc(fmt_pct(r.underflow))}</td>'
            f'<td class="num" data-v="{r.nonfinite}">{esc(fmt_compact(r.nonfinite))}</td></tr>'
        )
    head = (
        "<thead><tr>"
        '<th data-sort="text">module</th><th data-sort="text">type</th>'
        '<th class="num" data-sort="num">fwd amax</th><th class="num" data-sort="num">bwd amax</th>'
        '<th class="num" data-sort="num">headroom</th>'
        '<th class="num" data-sort="num">underflow</th>'
        '<th class="num" data-sort="num">nan/inf</th></tr></thead>'
    )
    sub = (
        f"Worst first. Headroom: binades (factors of 2) from the largest magnitude to "
        f"{esc(fmt.name)}'s max; red below 0 or non-finite, amber under 2. Underflow: share of "
        f"non-zero values below the smallest normal. Click a header to sort."
    )
    return _card(
        "modules",
        f"Modules ({len(trace.layers)})",
        f'<div class="table-wrap"><table class="data sortable">{head}<tbody>'
        f"{''.join(rows)}</tbody></table></div>",
        sub=sub,
    )


def _sortnum(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "-1"
    if math.isinf(x):
        return "1e308"
    return f"{x:.6g}"


def _warnings(trace: Trace) -> str:
    items = []
    for w in ranked_warnings(trace):
        module = f'<code class="module">{esc(w.module)}</code>' if w.module else ""
        items.append(
            f'<li class="warning"><div class="w-head"><span class="badge warn">'
            f"{esc(w.kind.replace('_', ' '))}</span>{module}"
            f'<span class="score" title="rank score">score {w.score:.2f}</span></div>'
            f"<p>{esc(w.message)}</p>{_list(w.evidence, 'evidence small')}</li>"
        )
    return _card(
        "warnings",
        f"Warnings ({len(trace.warnings)})",
        f'<ul class="warnings">{"".join(items)}</ul>',
    )


def _facts(facts: Sequence[str]) -> str:
    return _card(
        "facts",
        "Facts",
        _list(facts, "facts"),
        sub="Non-finite values that were seen but were not failures (for example, GradScaler "
        "skipping a step while it finds its scale).",
    )


def _ops(ops: Sequence[OpRecord]) -> str:
    rows = []
    for op in ops:
        cls = "culprit" if op.first_nonfinite else ("bad" if op.nonfinite else "")
        mark = ' <span class="badge bad">first non-finite</span>' if op.first_nonfinite else ""
        rows.append(
            f'<tr class="{cls}"><td class="num">{op.index}</td>'
            f'<td class="mono">{esc(op.op)}{mark}</td><td>{esc(op.phase)}</td>'
            f'<td class="mono">{esc(op.dtype)}</td><td class="num">{esc(fmt_num(op.amax))}</td>'
            f'<td class="num">{esc(fmt_count(op.nonfinite))}</td>'
            f'<td class="num">{esc(fmt_count(op.numel))}</td>'
            f'<td class="mono muted">{esc(op.source or "")}</td></tr>'
        )
    table = (
        '<div class="table-wrap"><table class="data"><thead><tr><th class="num">#</th>'
        '<th>op</th><th>phase</th><th>dtype</th><th class="num">amax</th>'
        '<th class="num">nan/inf</th><th class="num">numel</th><th>source</th></tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )
    return _card(
        "ops",
        "Op-level replay of the culprit",
        table,
        sub="Every aten op seen while replaying the failing module with its captured inputs.",
    )


def _ranks(trace: Trace) -> str:
    origin = trace.first_failure.rank if trace.first_failure else None
    rows = []
    for r in trace.ranks:
        level, status = rank_status(r)
        word, _, error = status.partition(": ")
        badge = f'<span class="badge {level}">{esc(word)}</span>'
        if error:
            badge += f'<div class="small rank-error">{esc(error)}</div>'
        ff = r.first_failure
        if ff is not None:
            fail = f'<td class="num bad-text">{ff.step}</td>' + "".join(
                f'<td class="mono bad-text">{esc(w)}</td>' for w in (ff.phase, ff.module, ff.tensor)
            )
        else:
            text = "no non-finite values" if r.answered else ""
            fail = f'<td colspan="4" class="ok-text">{esc(text)}</td>'
        counts = (len(r.steps), sum(s.skipped for s in r.steps)) if r.answered else ("—", "—")
        mark = "▶ " if r.rank == origin else ""
        rows.append(
            f'<tr class="{"culprit" if mark else ""}" data-rank="{r.rank}">'
            f'<td class="num">{mark}{r.rank}</td><td>{badge}</td>'
            f'<td class="num">{counts[0]}</td><td class="num">{counts[1]}</td>{fail}</tr>'
        )
    table = (
        '<div class="table-wrap"><table class="data ranks"><thead><tr>'
        '<th class="num">rank</th><th>status</th><th class="num">steps</th>'
        '<th class="num">skipped</th><th class="num">failure step</th><th>phase</th>'
        f"<th>module</th><th>tensor</th></tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
    )
    with_steps = [r for r in trace.ranks if r.steps]
    chart = ""
    if with_steps:
        series = [
            (
                f"rank {r.rank}",
                _svg.Series([(s.index, s.loss) for s in r.steps], colour=_svg.rank_colour(i)),
            )
            for i, r in enumerate(with_steps)
        ]
        legend = "".join(
            f'<span><i class="sw" style="background:{s.colour}"></i>{esc(label)}</span>'
            for label, s in series
        )
        fail = trace.first_failure.step if trace.first_failure else None
        svg = _svg.multi_line_chart(series, fail_step=fail)
        chart = (
            '<figure class="wide rank-loss"><figcaption>Loss per rank</figcaption>'
            f'<div class="legend">{legend}<span><i class="vline"></i>first failure</span>'
            f'<span><i class="cross">×</i>non-finite loss</span></div>'
            f'<div class="chart-wrap">{svg}</div></figure>'
        )
    details = "".join(_rank_steps(r) for r in with_steps)
    sub = (
        "Every rank of the run: whether it answered, its own first failure and its own steps. "
        "▶ marks the origin, the rank whose first failure came first; the sections above show "
        "its trace."
    )
    if trace.all_ranks_failed:
        sub += " Every rank failed alike: look at the model or its precision, not one rank's data."
    return _card("ranks", f"Ranks ({len(trace.ranks)})", f"{table}{chart}{details}", sub=sub)


def _rank_steps(r: RankSummary) -> str:
    fail = r.first_failure.step if r.first_failure else None
    table, shown = _step_rows(r.steps, fail, {})
    n = len(r.steps)
    parts = [f"rank {r.rank}", plural(n, "step")]
    if shown < n:
        parts.append(f"{shown} shown")
    parts.append(f"first failure at step {fail}" if fail is not None else "no non-finite values")
    if r.status in ("crashed", "interrupted"):
        parts.append(r.status)
    return (
        f'<details class="steps rank-steps" data-rank="{r.rank}">'
        f"<summary>{esc(' · '.join(parts))}</summary>{table}</details>"
    )


def _footer(trace: Trace) -> str:
    return (
        '<footer class="foot">'
        f"<span>nanhunt {esc(trace.run.nanhunt or __version__)} · report schema "
        f"v{trace.schema_version}</span>"
        '<button type="button" id="download-json" class="needs-js">Download trace JSON</button>'
        "</footer>"
    )


# ----------------------------------------------------------------------------- code


def _highlight(code: str) -> str:
    """Python source as escaped HTML with pygments token classes (plain escape without it)."""
    try:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer
    except ImportError:  # pragma: no cover - pygments ships with rich
        return esc(code)
    out = highlight(code, PythonLexer(), HtmlFormatter(nowrap=True))
    return out.rstrip("\n")


def _code_css() -> str:
    return (
        ".code .k,.code .kn,.code .kd,.code .kr,.code .kc,.code .ow,.code .kp,"
        ".src-line .k,.src-line .kn,.src-line .kc,.src-line .ow{color:#7c3aed;font-weight:600}"
        ".code .s,.code .s1,.code .s2,.code .sd,.code .sa,.code .se,.src-line .s1,"
        ".src-line .s2{color:#047857}"
        ".code .sd{color:#64748b}"
        ".code .c,.code .c1,.code .ch,.code .cm{color:#64748b;font-style:italic}"
        ".code .m,.code .mi,.code .mf,.code .mh,.src-line .mi,.src-line .mf{color:#b45309}"
        ".code .nb,.code .bp,.src-line .nb,.src-line .bp{color:#0369a1}"
        ".code .nf,.code .nc,.code .fm{color:#1d4ed8;font-weight:600}"
        ".code .nd{color:#9333ea}"
    )


_CSS = """
:root{--ink:#0f172a;--muted:#64748b;--line:#e2e8f0;--bg:#f1f5f9;--card:#fff;--bad:#dc2626;
--bad-bg:#fef2f2;--warn:#b45309;--warn-bg:#fffbeb;--ok:#15803d;--ok-bg:#f0fdf4;--fwd:#2563eb;
--bwd:#d97706;--mono:ui-monospace,SFMono-Regular,"SF Mono",Menlo,Consolas,"DejaVu Sans Mono",
"Liberation Mono",monospace}
*{box-sizing:border-box}
html{-webkit-text-size-adjust:100%}
body{margin:0;background:var(--bg);color:var(--ink);font:15px/1.55 system-ui,-apple-system,
"Segoe UI",Roboto,"Helvetica Neue","Liberation Sans",Arial,sans-serif;
font-feature-settings:"tnum" 1}
code,.mono,pre{font-family:var(--mono);font-size:.92em}
a{color:#1d4ed8;text-decoration:none}a:hover{text-decoration:underline}
.topbar{background:#0f172a;color:#e2e8f0}
.topbar-inner{max-width:1180px;margin:0 auto;padding:10px 32px;display:flex;gap:16px;
align-items:baseline}
.brand{font-weight:700;letter-spacing:.02em;font-size:16px;color:#fff}
.logo{color:#f87171;margin-right:7px}
.topmeta{color:#94a3b8;font-size:13px;font-family:var(--mono)}
.page{max-width:1180px;margin:0 auto;padding:24px 32px 56px}
.verdict{border-radius:14px;padding:22px 26px 18px;margin:0 0 14px;border:1px solid;
border-left-width:7px;background:var(--card)}
.verdict.problem{background:var(--bad-bg);border-color:#fecaca;border-left-color:var(--bad)}
.verdict.ok{background:var(--ok-bg);border-color:#bbf7d0;border-left-color:var(--ok)}
.verdict.partial{background:var(--warn-bg);border-color:#fde68a;border-left-color:var(--warn)}
.verdict h1{margin:0;font-size:24px;line-height:1.3;letter-spacing:-.01em;
overflow-wrap:break-word}
@media (max-width:600px){.verdict h1{font-size:20px}}
.verdict.problem h1{color:#991b1b}.verdict.ok h1{color:#166534}.verdict.partial h1{color:#92400e}
.verdict .exit-note{margin:4px 0 0;font-weight:700}
.verdict .partial{margin:0 0 6px;font-weight:700;color:var(--warn);font-size:14px;
letter-spacing:.03em}
.verdict .lede{margin:8px 0 0;font-size:16px;max-width:70em;color:#334155}
.chips{display:flex;flex-wrap:wrap;gap:6px;margin-top:12px}
.chip{background:rgba(255,255,255,.75);border:1px solid var(--line);border-radius:999px;
padding:2px 10px;font-size:12.5px;color:#334155}
.toc{display:flex;flex-wrap:wrap;gap:4px 18px;margin:4px 2px 8px;font-size:13.5px}
.toc a{color:var(--muted)}.toc a:hover{color:var(--ink)}
.card{background:var(--card);border:1px solid var(--line);border-radius:14px;
padding:20px 24px;margin:16px 0;box-shadow:0 1px 2px rgba(15,23,42,.04)}
.card h2{margin:0 0 4px;font-size:17px;letter-spacing:-.005em}
.card h3{font-size:14px;margin:16px 0 6px}
.sub{margin:0 0 14px;color:var(--muted);font-size:13.5px;max-width:80em}
.card>h2+*:not(.sub){margin-top:12px}
.two-col{display:grid;grid-template-columns:minmax(0,1.05fr) minmax(0,1fr);gap:16px}
.two-col>.card{margin:0}
@media (max-width:900px){.two-col{grid-template-columns:1fr}.page{padding:16px}}
.facts-grid{display:grid;grid-template-columns:max-content 1fr max-content 1fr;gap:5px 18px;
margin:12px 0 0;font-size:14px}
.facts-grid dt{color:var(--muted)}.facts-grid dd{margin:0;overflow-wrap:anywhere}
@media (max-width:900px){.facts-grid{grid-template-columns:max-content 1fr}}
pre.error{background:var(--bad-bg);border:1px solid #fecaca;color:#7f1d1d;padding:10px 12px;
border-radius:8px;white-space:pre-wrap;overflow-wrap:anywhere;max-height:22em;overflow:auto}
.kv-row{display:flex;flex-wrap:wrap;gap:8px 22px;margin:12px 0 10px}
.kv{display:flex;flex-direction:column}
.kv .k{font-size:11.5px;text-transform:uppercase;letter-spacing:.06em;color:var(--muted)}
.kv .v{font-weight:600;overflow-wrap:anywhere}
.source{border:1px solid var(--line);border-radius:8px;overflow:hidden;margin:6px 0 12px}
.src-loc{background:#f8fafc;border-bottom:1px solid var(--line);padding:4px 12px;
font-size:12.5px;color:var(--muted)}
.src-line{margin:0;padding:10px 12px;background:#fff;white-space:pre-wrap;
overflow-wrap:anywhere;border-left:4px solid var(--bad)}
.stats{display:flex;flex-wrap:wrap;gap:8px;margin:4px 0 8px}
.stat{border:1px solid var(--line);border-radius:10px;padding:6px 12px;min-width:78px;
display:flex;flex-direction:column;background:#f8fafc}
.stat-v{font-weight:700;font-size:16px;font-family:var(--mono)}
.stat-k{font-size:11.5px;color:var(--muted);text-transform:uppercase;letter-spacing:.05em}
.stat.bad{background:var(--bad-bg);border-color:#fecaca}.stat.bad .stat-v{color:var(--bad)}
.stat.warn{background:var(--warn-bg);border-color:#fde68a}.stat.warn .stat-v{color:var(--warn)}
.muted{color:var(--muted)}.small{font-size:13px}.detail{margin:6px 0 0;font-size:14px}
.badges{display:flex;gap:6px;flex-wrap:wrap;margin:10px 0 8px}
.badge{display:inline-block;border-radius:6px;padding:1px 8px;font-size:12.5px;
font-weight:600;border:1px solid transparent;white-space:nowrap}
.badge.bad{background:#fee2e2;color:#991b1b}.badge.warn{background:#fef3c7;color:#92400e}
.badge.ok{background:#dcfce7;color:#166534}
.badge.plain{background:#f1f5f9;color:#475569;border-color:var(--line)}
.fix{margin:8px 0 0;color:#334155}
.badge.type{background:#eef2ff;color:#3730a3}
.message{margin:0 0 8px;font-size:15.5px}
ul.evidence{margin:6px 0 0;padding-left:20px}ul.evidence li{margin:3px 0}
.rec ul.evidence{font-size:14px;color:#334155}
ul.evidence li::marker{color:var(--muted)}
.legend{display:flex;flex-wrap:wrap;gap:6px 18px;font-size:12.5px;color:#475569;
margin:0 0 10px}
.legend span{display:inline-flex;align-items:center;gap:6px}
.sw{display:inline-block;width:18px;height:9px;border-radius:5px}
.sw.zone-sub{background:#fef3c7;border:1px solid #fcd34d;border-radius:2px}
.sw.zone-over{background:#fee2e2;border:1px solid #fca5a5;border-radius:2px}
.sw.zone-flush{background:repeating-linear-gradient(45deg,#e2e8f0 0 3px,#f1f5f9 3px 6px);
border:1px solid #cbd5e1;border-radius:2px}
.dia{display:inline-block;width:8px;height:8px;background:var(--bad);transform:rotate(45deg)}
.vline{display:inline-block;width:0;height:12px;border-left:2px dashed var(--bad)}
.cross{font-style:normal;color:var(--bad);font-weight:700}
.chart-wrap{overflow-x:auto}
.chart-wrap svg{display:block;min-width:720px}
.range-split{display:flex;align-items:flex-start;min-width:720px}
.chart-wrap .range-split svg{min-width:0;height:auto}
.range-names{position:sticky;left:0;z-index:1}
svg text.mono{font-family:var(--mono)}
svg{font-family:inherit}
.mini-grid{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:10px 22px}
@media (max-width:900px){.mini-grid{grid-template-columns:1fr}}
figure.mini{margin:0}figure.wide{margin:0 0 8px}
figure.wide figcaption{font-size:13px;font-weight:600;color:#334155;margin:4px 0}
figure.mini figcaption{font-size:13px;font-weight:600;color:#334155;margin:4px 0 0 4px;
overflow-wrap:anywhere}
details.steps{margin-top:14px}
details.steps summary{cursor:pointer;color:var(--muted);font-size:13.5px}
.table-wrap{overflow-x:auto}
table.data{border-collapse:collapse;width:100%;font-size:13.5px;margin-top:8px}
table.data th{text-align:left;font-weight:600;color:var(--muted);font-size:12px;
text-transform:uppercase;letter-spacing:.05em;border-bottom:1px solid var(--line);
padding:6px 10px;white-space:nowrap}
table.data td{padding:5px 10px;border-bottom:1px solid #f1f5f9;vertical-align:top}
table.data td.mono{overflow-wrap:break-word}
table.data .num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.data tr.culprit td{background:#fef2f2;font-weight:600}
table.data tr.culprit td:first-child{box-shadow:inset 3px 0 0 var(--bad)}
table.data tr.bad td{color:#991b1b}
table.data tr.gap td{color:var(--muted);font-style:italic;background:#f8fafc}
td.head.bad{color:var(--bad);font-weight:700}td.head.warn{color:var(--warn);font-weight:700}
td.head.ok{color:var(--ok)}
table.sortable th[data-sort]{cursor:pointer}
table.sortable th[data-sort]:hover{color:var(--ink)}
th.sorted-asc::after{content:" ▲"}th.sorted-desc::after{content:" ▼"}
.rec{border:1px solid var(--line);border-radius:12px;padding:14px 16px;margin:12px 0 0}
.rec.verified{border-color:#bbf7d0;box-shadow:inset 4px 0 0 #22c55e}
.rec header{display:flex;flex-wrap:wrap;align-items:center;gap:8px 10px}
.num-badge{display:inline-flex;width:22px;height:22px;border-radius:50%;background:var(--ink);
color:#fff;font-size:12px;font-weight:700;align-items:center;justify-content:center}
code.module{background:#f1f5f9;border-radius:5px;padding:1px 6px;overflow-wrap:anywhere}
.value{color:var(--muted);font-size:14px}
.check{display:flex;flex-wrap:wrap;gap:8px;align-items:baseline;margin:8px 0 2px;
font-size:14px}
.verification{color:#334155}
.snippet{position:relative;margin-top:10px}
pre.code{margin:0;background:#f8fafc;border:1px solid var(--line);border-radius:8px;
padding:12px 14px;overflow-x:auto;line-height:1.5;font-size:13px}
button{font:inherit;font-size:12.5px;border:1px solid #cbd5e1;background:#fff;
border-radius:6px;padding:3px 10px;cursor:pointer;color:#334155}
button:hover{background:#f1f5f9}
button.copy{position:absolute;top:8px;right:8px}
button.copy.done{background:#dcfce7;border-color:#86efac;color:#166534}
html:not([data-js=ready]) .needs-js{display:none}
ul.warnings{list-style:none;margin:10px 0 0;padding:0}
li.warning{border-top:1px solid #f1f5f9;padding:10px 0}
li.warning:first-child{border-top:0}
li.warning p{margin:4px 0 0}
.w-head{display:flex;flex-wrap:wrap;gap:8px;align-items:center}
.score{margin-left:auto;color:var(--muted);font-size:12.5px}
ul.facts{margin:8px 0 0;padding-left:20px}ul.facts li{margin:3px 0}
.bad-text{color:var(--bad)}.ok-text{color:var(--ok)}
.rank-error{color:#7f1d1d;overflow-wrap:anywhere;margin-top:2px}
figure.rank-loss{margin-top:16px}
.empty{color:var(--muted);font-style:italic}
.foot{display:flex;justify-content:space-between;align-items:center;color:var(--muted);
font-size:13px;margin-top:26px}
@media print{body{background:#fff}.card,.verdict{break-inside:avoid;box-shadow:none}
.needs-js,.toc{display:none}}
"""

_JS = r"""
(function () {
  "use strict";
  var root = document.documentElement;
  var data;
  try {
    data = JSON.parse(document.getElementById("nanhunt-data").textContent);
  } catch (err) {
    root.setAttribute("data-js", "error");
    return;
  }
  root.setAttribute("data-js", "ready");

  function copyText(text, done) {
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, function () { fallback(text, done); });
    } else {
      fallback(text, done);
    }
  }
  function fallback(text, done) {
    var area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    try { document.execCommand("copy"); done(); } catch (err) { /* nothing to do */ }
    document.body.removeChild(area);
  }
  Array.prototype.forEach.call(document.querySelectorAll("button.copy"), function (btn) {
    btn.addEventListener("click", function () {
      var code = btn.parentNode.querySelector("code");
      copyText(code.textContent, function () {
        btn.textContent = "Copied";
        btn.classList.add("done");
        setTimeout(function () { btn.textContent = "Copy"; btn.classList.remove("done"); }, 1500);
      });
    });
  });

  var dl = document.getElementById("download-json");
  if (dl) {
    dl.addEventListener("click", function () {
      var blob = new Blob([JSON.stringify(data, null, 1)], {type: "application/json"});
      var a = document.createElement("a");
      a.href = URL.createObjectURL(blob);
      a.download = "report.json";
      document.body.appendChild(a);
      a.click();
      setTimeout(function () { URL.revokeObjectURL(a.href); a.remove(); }, 0);
    });
  }

  // a chart wider than a narrow window scrolls: open it on the culprit's bars and the max line
  // (the left end is the subnormal zone), and say where it went (data-scrolled) for tests
  function showCulprit() {
    Array.prototype.forEach.call(document.querySelectorAll(".chart-wrap"), function (wrap) {
      if (wrap.scrollWidth <= wrap.clientWidth + 1) { wrap.scrollLeft = 0; return; }
      var box = wrap.getBoundingClientRect(), cw = wrap.clientWidth;
      function span(selector) {
        var lo = Infinity, hi = -Infinity;
        Array.prototype.forEach.call(wrap.querySelectorAll(selector), function (m) {
          var r = m.getBoundingClientRect();
          lo = Math.min(lo, r.left - box.left + wrap.scrollLeft);
          hi = Math.max(hi, r.right - box.left + wrap.scrollLeft);
        });
        return lo <= hi ? [lo, hi] : null;
      }
      var culprit = span("g.culprit rect.forward, g.culprit rect.backward, " +
                         "g.culprit .nonfinite-mark");
      var both = span("g.culprit rect.forward, g.culprit rect.backward, " +
                      "g.culprit .nonfinite-mark, line.limit-max");
      // the module names stay on the left (sticky): the bars show in the rest
      var names = wrap.querySelector(".range-names");
      var nw = names ? names.getBoundingClientRect().width : 0, room = cw - nw;
      var s = both && (!culprit || both[1] - both[0] + 40 <= room) ? both : culprit;
      if (!s) { return; }
      // the whole span when it fits, centred; else its right end (where values overflow)
      var target = s[1] - s[0] + 40 <= room ? (s[0] + s[1] - cw - nw) / 2 : s[1] + 24 - cw;
      wrap.scrollLeft = Math.max(0, Math.min(target, wrap.scrollWidth - cw));
      wrap.setAttribute("data-scrolled", String(Math.round(wrap.scrollLeft)));
    });
  }
  showCulprit();
  window.addEventListener("resize", showCulprit);

  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
    var heads = table.querySelectorAll("th[data-sort]");
    Array.prototype.forEach.call(heads, function (th, col) {
      th.addEventListener("click", function () {
        var asc = !th.classList.contains("sorted-asc");
        Array.prototype.forEach.call(heads, function (h) {
          h.classList.remove("sorted-asc", "sorted-desc");
        });
        th.classList.add(asc ? "sorted-asc" : "sorted-desc");
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        var numeric = th.getAttribute("data-sort") === "num";
        rows.sort(function (a, b) {
          var x = a.cells[col].getAttribute("data-v") || a.cells[col].textContent;
          var y = b.cells[col].getAttribute("data-v") || b.cells[col].textContent;
          var r = numeric ? parseFloat(x) - parseFloat(y) : x.localeCompare(y);
          return asc ? r : -r;
        });
        rows.forEach(function (row) { body.appendChild(row); });
      });
    });
  });
})();
"""
