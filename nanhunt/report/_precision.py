"""The precision audit's part of the reports (``Trace.precision``): terminal, HTML and SVG.

Reads only the trace. Layers are shown worst first (``rank``); containers whose loss a child
explains are listed only with ``--all``. The HTML chart plots each layer's own SQNR and its
end-to-end SQNR along the model's depth (execution order), with the standout threshold.
"""

from __future__ import annotations

import math

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from nanhunt.analyse.rank import JUMP_DB
from nanhunt.report._svg import MUTED, esc, n
from nanhunt.trace import PrecisionAudit, PrecisionLayer, Trace

__all__ = ["audit_panel", "html_card", "html_verdict", "is_audit", "sqnr_chart",
           "terminal_section"]

#: SQNR drawn at the top of the chart for exact layers (dB above the nominal level)
_EXACT_HEADROOM = 15.0


def is_audit(trace: Trace) -> bool:
    """A report made by ``nanhunt audit`` alone (no diagnose steps)."""
    return trace.precision is not None and not trace.steps and trace.first_failure is None


def fmt_db(x: float | None) -> str:
    if x is None:
        return "—"
    if math.isinf(x):
        return "exact" if x > 0 else "-inf"
    if math.isnan(x):
        return "nan"
    return f"{x:.1f}"


def fmt_jump(x: float | None) -> str:
    """The drift jump: dB the end-to-end SQNR drops across the layer; 'start' where its
    inputs were exact (the drift starts there)."""
    if x is None:
        return "—"
    if math.isinf(x):
        return "start" if x > 0 else "-inf"
    return f"{x:+.1f}"


def _ordered(audit: PrecisionAudit, show_all: bool) -> list[PrecisionLayer]:
    ranked = sorted((x for x in audit.layers if x.rank is not None), key=lambda x: x.rank)
    if show_all:
        ranked += [x for x in audit.layers if x.rank is None]
    return ranked


def headline(audit: PrecisionAudit) -> tuple[str, str]:
    """(text, level) of the audit's verdict."""
    out = [x.module for x in audit.layers if x.stands_out]
    if out:
        return (f"AUDIT {audit.target}: {len(out)} layer{'s' if len(out) > 1 else ''} "
                f"lose{'' if len(out) > 1 else 's'} far more than the rest: "
                + ", ".join(out[:4]) + (" …" if len(out) > 4 else ""), "warning")
    if not audit.layers:
        return f"AUDIT {audit.target}: no module calls were measured", "warning"
    return f"AUDIT {audit.target}: no layer stands out", "ok"


def _loss_line(audit: PrecisionAudit) -> str:
    loss = audit.loss
    if loss is None or loss.target is None or loss.float32 is None:
        return "loss: not measured"
    err = loss.error
    return (f"loss, audited step {loss.step}: {audit.target} {loss.target:.6g} · float32 "
            f"{loss.float32:.6g} · rel. error {err:.2g}" if err is not None else "")


def audit_panel(trace: Trace) -> Panel:
    audit = trace.precision
    assert audit is not None
    text, level = headline(audit)
    style = {"ok": "bold green", "warning": "bold yellow"}[level]
    body = Text(text, style=style)
    run = [p for p in (trace.run.script, f"torch {trace.run.torch}" if trace.run.torch else "",
                       trace.run.device) if p]
    run.append(f"{audit.steps} audited step{'s' if audit.steps != 1 else ''}")
    body.append("\n" + " · ".join(run), style="dim")
    body.append(f"\n{audit.mode}: {audit.simulation}", style="dim")
    return Panel(body, box=box.ROUNDED, expand=True,
                 border_style="green" if level == "ok" else "yellow")


def terminal_section(console: Console, trace: Trace, *, show_all: bool = False,
                     max_layers: int = 12) -> None:
    audit = trace.precision
    assert audit is not None
    console.print()
    console.rule(Text("Precision audit: layers, worst first", style="bold"), align="left",
                 style="dim")
    console.print(Text(f"SQNR in dB against float32, higher is better; rounding to "
                       f"{audit.target} alone gives {fmt_db(audit.nominal_sqnr_db)}, layers "
                       f"below {fmt_db(audit.threshold_db)} stand out. own: the layer alone on "
                       "the same inputs; e2e: against a float32 run of the whole model; jump: "
                       "how far e2e drops from its inputs to its output (start: exact inputs); "
                       "grad: its output's gradient.", style="dim"))
    console.print(Text(_loss_line(audit), style="dim"))
    rows = _ordered(audit, show_all)
    shown = rows if show_all else rows[:max_layers]
    others = audit.compare
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), expand=False)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("module", overflow="fold", ratio=3)
    table.add_column("type", overflow="fold", ratio=2)
    table.add_column("own", justify="right", no_wrap=True)
    table.add_column("e2e", justify="right", no_wrap=True)
    table.add_column("jump", justify="right", no_wrap=True)
    table.add_column("grad", justify="right", no_wrap=True)
    for o in others:
        table.add_column(_short(o.target), justify="right", no_wrap=True)
    by_other = [{x.module: x for x in o.layers} for o in others]
    for layer in shown:
        style = "bold yellow" if layer.stands_out else ""
        cells = [str(layer.rank) if layer.rank is not None else "·", layer.module, layer.type,
                 fmt_db(layer.sqnr_db), fmt_db(layer.sqnr_db_end_to_end),
                 fmt_jump(layer.drift_jump_db), fmt_db(layer.grad_sqnr_db)]
        cells += [fmt_db(m[layer.module].sqnr_db) if layer.module in m else "—"
                  for m in by_other]
        table.add_row(*cells, style=style)
    console.print(table)
    hidden = len(rows) - len(shown)
    explained = sum(1 for x in audit.layers if x.rank is None)
    notes = []
    if hidden:
        notes.append(f"{hidden} more ranked layers (--all shows them)")
    if explained and not show_all:
        notes.append(f"{explained} containers whose loss a child explains (--all)")
    if others:
        notes.append("own = " + audit.target + "; " + ", ".join(
            f"{_short(o.target)} = {o.target} ({o.mode})" for o in others) + ": own SQNR")
    if notes:
        console.print(Text("  " + "; ".join(notes), style="dim"))
    for layer in [x for x in rows if x.stands_out][:4]:
        if layer.reasons:
            grid = Table.grid(padding=(0, 1))
            grid.add_column(no_wrap=True)
            grid.add_column(overflow="fold")
            for r in layer.reasons:
                grid.add_row("•", r)
            console.print(Group(Text(f"  why {layer.module} loses:", style="bold"), grid))
    for o in others:
        t, _ = headline(o)
        console.print(Text(f"  {t}  ({_loss_line(o)})", style="dim"))
    for note in audit.notes:
        console.print(Text("  note: " + note, style="yellow"))


def _short(name: str) -> str:
    return {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3",
            "float8_e5m2": "e5m2"}.get(name, name)


# ----------------------------------------------------------------------------- HTML


def html_verdict(trace: Trace) -> str:
    audit = trace.precision
    assert audit is not None
    text, level = headline(audit)
    chips = [f"{audit.steps} audited steps", f"{audit.mode}: {audit.simulation}"]
    if trace.run.device:
        chips.append(trace.run.device)
    if trace.recommendations:
        verified = sum(r.verified for r in trace.recommendations)
        chips.append(f"{len(trace.recommendations)} fp32 advice, {verified} checked")
    chip_html = "".join(f'<span class="chip">{esc(c)}</span>' for c in chips)
    return (f'<section id="verdict" class="verdict {level}" data-level="{level}">'
            f"<h1>{esc(text)}</h1><p class=\"lede\">{esc(_loss_line(audit))}</p>"
            f'<div class="chips">{chip_html}</div></section>')


def html_card(trace: Trace) -> str:
    audit = trace.precision
    assert audit is not None
    audits = [audit, *audit.compare]
    parts = []
    for a in audits:
        parts.append(f"<h3>{esc(a.target)} <span class=\"sub\">({esc(a.mode)}: "
                     f"{esc(a.simulation)})</span></h3>")
        parts.append(f'<p class="sub">{esc(_loss_line(a))}</p>')
        parts.append(sqnr_chart(a))
        parts.append(_html_table(a))
        for note in a.notes:
            parts.append(f'<p class="sub">note: {esc(note)}</p>')
    return (f'<section id="precision" class="card"><h2>Precision audit</h2>'
            f'<p class="sub">SQNR in dB against float32 (higher is better): own = the layer '
            f"alone on the same inputs, e2e = against a float32 run of the whole model on the "
            f"same batch, jump = how far e2e drops from the layer's inputs to its output "
            f"(start: its inputs were exact), grad = the gradient of its output.</p>"
            f"{''.join(parts)}</section>")


def _html_table(audit: PrecisionAudit) -> str:
    rows = []
    for layer in _ordered(audit, True):
        cls = ' class="bad"' if layer.stands_out else ""
        why = "<br>".join(esc(r) for r in layer.reasons[:4])
        rows.append(
            f"<tr{cls}><td>{layer.rank if layer.rank is not None else '·'}</td>"
            f"<td class=\"mono\">{esc(layer.module)}</td><td>{esc(layer.type)}</td>"
            f"<td>{fmt_db(layer.sqnr_db)}</td><td>{fmt_db(layer.sqnr_db_end_to_end)}</td>"
            f"<td>{fmt_jump(layer.drift_jump_db)}</td>"
            f"<td>{fmt_db(layer.grad_sqnr_db)}</td><td>{why}</td></tr>")
    return ('<div class="table-wrap"><table class="modules"><thead><tr><th>#</th>'
            "<th>module</th><th>type</th><th>own</th><th>e2e</th><th>jump</th><th>grad</th>"
            "<th>why</th>"
            f"</tr></thead><tbody>{''.join(rows)}</tbody></table></div>")


def sqnr_chart(audit: PrecisionAudit, width: int = 640, height: int = 220) -> str:
    """Own SQNR (dots) and end-to-end SQNR (line) of each layer along the depth."""
    layers = [x for x in sorted(audit.layers, key=lambda x: x.order)
              if x.rank is not None or x.leaf]
    if not layers:
        return '<svg class="chart empty" viewBox="0 0 640 40" width="100%"></svg>'
    values = [v for x in layers for v in (x.sqnr_db, x.sqnr_db_end_to_end)
              if v is not None and math.isfinite(v)]
    top = max([*values, audit.nominal_sqnr_db or 0.0]) + _EXACT_HEADROOM
    low = min([*values, audit.threshold_db or 0.0, 0.0])
    ml, mr, mt, mb = 44, 12, 12, 30
    px0, px1, py0, py1 = ml, width - mr, mt, height - mb

    def x_of(i: int) -> float:
        return px0 + (i + 0.5) / len(layers) * (px1 - px0)

    def y_of(v: float | None) -> float:
        if v is None or math.isnan(v):
            v = low
        v = top if math.isinf(v) and v > 0 else (low if math.isinf(v) else v)
        return py1 - (v - low) / (top - low or 1.0) * (py1 - py0)

    out = [f'<svg class="chart sqnr" viewBox="0 0 {width} {height}" width="100%" '
           'role="img" aria-label="SQNR per layer along the depth">']
    step = 20 if top - low > 60 else 10
    k = math.ceil(low / step) * step
    while k <= top:
        y = n(y_of(k))
        out.append(f'<line x1="{px0}" x2="{px1}" y1="{y}" y2="{y}" stroke="#e2e8f0"/>'
                   f'<text x="{px0 - 4}" y="{n(y_of(k) + 4)}" text-anchor="end" '
                   f'fill="{MUTED}" font-size="10">{k:.0f}</text>')
        k += step
    for level, label, colour in ((audit.nominal_sqnr_db, "rounding alone", "#64748b"),
                                 (audit.threshold_db, "stands out below", "#dc2626")):
        if level is not None:
            y = n(y_of(level))
            out.append(f'<line x1="{px0}" x2="{px1}" y1="{y}" y2="{y}" stroke="{colour}" '
                       f'stroke-dasharray="5 3"/><text x="{px1 - 2}" y="{n(y_of(level) - 3)}" '
                       f'text-anchor="end" fill="{colour}" font-size="10">{esc(label)} '
                       f"{level:.0f} dB</text>")
    pts = [f"{n(x_of(i))},{n(y_of(x.sqnr_db_end_to_end))}" for i, x in enumerate(layers)
           if x.sqnr_db_end_to_end is not None]
    if len(pts) > 1:
        out.append(f'<polyline class="e2e" points="{" ".join(pts)}" fill="none" '
                   'stroke="#2563eb" stroke-width="1.5"/>')
    for i, x in enumerate(layers):  # where the drift jumps: e2e from its inputs to its output
        jump, e_in, e_out = x.drift_jump_db, x.sqnr_db_end_to_end_in, x.sqnr_db_end_to_end
        if jump is not None and math.isfinite(jump) and jump >= JUMP_DB and \
                e_in is not None and e_out is not None:
            out.append(f'<line class="jump" x1="{n(x_of(i))}" x2="{n(x_of(i))}" '
                       f'y1="{n(y_of(e_in))}" y2="{n(y_of(e_out))}" stroke="#f59e0b" '
                       f'stroke-width="6" stroke-opacity="0.6"><title>{esc(x.module)}: the '
                       f"end-to-end SQNR drops {jump:.1f} dB across it ({fmt_db(e_in)} → "
                       f"{fmt_db(e_out)} dB)</title></line>")
    for i, x in enumerate(layers):
        colour = "#dc2626" if x.stands_out else "#0f766e"
        tip = (f"{x.module} ({x.type}): own {fmt_db(x.sqnr_db)} dB, end to end "
               f"{fmt_db(x.sqnr_db_end_to_end)} dB (jump {fmt_jump(x.drift_jump_db)}), grad "
               f"{fmt_db(x.grad_sqnr_db)} dB")
        out.append(f'<circle class="own" cx="{n(x_of(i))}" cy="{n(y_of(x.sqnr_db))}" r="4" '
                   f'fill="{colour}"><title>{esc(tip)}</title></circle>')
    if len(layers) <= 16:
        for i, x in enumerate(layers):
            label = x.module if len(x.module) <= 12 else "…" + x.module[-11:]
            out.append(f'<text x="{n(x_of(i))}" y="{height - 14}" text-anchor="middle" '
                       f'fill="{MUTED}" font-size="9">{esc(label)}</text>')
    out.append(f'<text x="{px0}" y="{height - 2}" fill="{MUTED}" font-size="10">depth '
               "(execution order) → · dots: own SQNR · line: end to end · amber bar: the drift "
               "jumps</text></svg>")
    return "".join(out)
