"""Server-side SVG charts for the HTML report: no JavaScript, no network, escaped text.

Every chart is a function from plain numbers (and the target :class:`NumberFormat`) to an SVG
string. Magnitudes are drawn on a log2 axis, where one unit is one binade, so the target format's
window (smallest subnormal, smallest normal, max) is a fixed band the data either fits or leaves.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from nanhunt.formats import NumberFormat
from nanhunt.report._common import fmt_compact, fmt_num, superscript
from nanhunt.trace import Failure, LayerStats, TensorStats

# colours shared with the page's CSS
FWD = "#2563eb"
BWD = "#d97706"
BAD = "#dc2626"
INK = "#0f172a"
MUTED = "#64748b"
GRID = "#e2e8f0"
ZONE_FLUSH = "#e2e8f0"
ZONE_SUB = "#fef3c7"
ZONE_OVER = "#fee2e2"

_FONT = 'font-family="inherit"'


def esc(s: object) -> str:
    return html.escape(str(s), quote=True)


def log2(x: float | None) -> float | None:
    if x is None or not (x > 0) or math.isinf(x):
        return None
    return math.log2(x)


def n(v: float) -> str:
    """A coordinate: one decimal, never nan/inf."""
    if not math.isfinite(v):
        v = 0.0
    s = f"{v:.1f}"
    return s[:-2] if s.endswith(".0") else s


def pow2_label(k: int) -> str:
    return "2" + superscript(k)


def _tick_step(span: float, max_ticks: int) -> int:
    for step in (1, 2, 4, 8, 16, 32, 64):
        if span / step <= max_ticks:
            return step
    return 128


def nice_ticks(lo: float, hi: float, count: int = 4) -> list[float]:
    """Round-number ticks covering ``lo..hi`` (linear axis)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    ticks = []
    t = start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    return ticks


@dataclass(frozen=True)
class _Axis:
    """Maps a log2 value (binade) to an x pixel."""

    lo: float
    hi: float
    x0: float
    x1: float

    def x(self, v: float) -> float:
        v = min(max(v, self.lo), self.hi)
        return self.x0 + (v - self.lo) / (self.hi - self.lo) * (self.x1 - self.x0)


def binade_domain(fmt: NumberFormat, values: Iterable[float], pad: int = 2) -> tuple[int, int]:
    """A log2 axis range covering the format's window and every observed magnitude."""
    lo = fmt.min_subnormal_binade - pad
    hi = fmt.max_binade + 1 + pad
    for v in values:
        b = log2(v)
        if b is None:
            continue
        lo = min(lo, math.floor(b) - 1)
        hi = max(hi, math.ceil(b) + 1)
    # a stray float32 denormal must not squash the picture
    return max(lo, fmt.min_subnormal_binade - 40, -160), min(hi, fmt.max_binade + 40, 140)


def _limits(fmt: NumberFormat) -> tuple[float, float, float]:
    """log2 of the smallest subnormal, the smallest normal and the max."""
    return (
        math.log2(fmt.smallest_subnormal),
        math.log2(fmt.smallest_normal),
        math.log2(fmt.max),
    )


def _zones(axis: _Axis, fmt: NumberFormat, y0: float, y1: float) -> list[str]:
    sub, norm, top = _limits(fmt)
    xs, xn, xm = axis.x(sub), axis.x(norm), axis.x(top)
    h = y1 - y0
    return [
        f'<rect x="{n(axis.x0)}" y="{n(y0)}" width="{n(xs - axis.x0)}" height="{n(h)}" '
        f'fill="url(#hatch)" class="zone-flush"/>',
        f'<rect x="{n(xs)}" y="{n(y0)}" width="{n(xn - xs)}" height="{n(h)}" '
        f'fill="{ZONE_SUB}" class="zone-subnormal"/>',
        f'<rect x="{n(xm)}" y="{n(y0)}" width="{n(axis.x1 - xm)}" height="{n(h)}" '
        f'fill="{ZONE_OVER}" class="zone-overflow"/>',
    ]


def _limit_lines(axis: _Axis, fmt: NumberFormat, y0: float, y1: float) -> list[str]:
    out = []
    sub, norm, top = _limits(fmt)
    for b, colour, dash, cls in (
        (sub, MUTED, "4 3", "limit-subnormal"),
        (norm, "#b45309", "", "limit-normal"),
        (top, BAD, "", "limit-max"),
    ):
        x = n(axis.x(b))
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<line class="{cls}" x1="{x}" x2="{x}" y1="{n(y0)}" y2="{n(y1)}" '
            f'stroke="{colour}" stroke-width="1.5"{dash_attr}/>'
        )
    return out


def _text_width(text: str, size: float = 11) -> float:
    """A rough rendered width (bold sans-serif) used to keep labels inside the chart."""
    return len(text) * size * 0.62


def _limit_labels(axis: _Axis, fmt: NumberFormat, y: float, left: float = 0) -> list[str]:
    sub, norm, top = _limits(fmt)
    labels = [
        (axis.x(sub), "end", MUTED, f"smallest subnormal {pow2_label(fmt.min_subnormal_binade)}"),
        (axis.x(norm), "start", "#b45309", f"smallest normal {pow2_label(fmt.min_normal_binade)}"),
        (axis.x(top), "end", BAD, f"{fmt.name} max {fmt.max:g}"),
    ]
    out = []
    for x, anchor, colour, text in labels:
        if anchor == "end" and x - 4 - _text_width(text) < left:
            anchor = "start"
        dx = -4 if anchor == "end" else 4
        out.append(
            f'<text x="{n(x + dx)}" y="{n(y)}" text-anchor="{anchor}" fill="{colour}" '
            f'font-size="11" font-weight="600">{esc(text)}</text>'
        )
    return out


def _binade_ticks(axis: _Axis, y0: float, y1: float, label_y: float, max_ticks: int) -> list[str]:
    step = _tick_step(axis.hi - axis.lo, max_ticks)
    out = []
    k = math.ceil(axis.lo / step) * step
    while k <= axis.hi:
        x = n(axis.x(k))
        out.append(f'<line x1="{x}" x2="{x}" y1="{n(y0)}" y2="{n(y1)}" stroke="{GRID}"/>')
        out.append(
            f'<text x="{x}" y="{n(label_y)}" text-anchor="middle" fill="{MUTED}" '
            f'font-size="11">{pow2_label(k)}</text>'
        )
        k += step
    return out


_DEFS = (
    "<defs>"
    '<pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
    'patternTransform="rotate(45)">'
    f'<rect width="6" height="6" fill="#f1f5f9"/>'
    f'<line x1="0" y1="0" x2="0" y2="6" stroke="{ZONE_FLUSH}" stroke-width="3"/>'
    "</pattern>"
    "</defs>"
)


def _short_name(name: str, limit: int) -> str:
    """Keep the end of a long module name: it is the part that tells siblings apart."""
    return name if len(name) <= limit else "…" + name[-(limit - 1) :]


def _bar(
    axis: _Axis, stats: TensorStats | None, y: float, h: float, colour: str, cls: str
) -> list[str]:
    if stats is None:
        return []
    hi, lo = log2(stats.amax), log2(stats.amin)
    out: list[str] = []
    if hi is not None:
        lo = hi if lo is None or lo > hi else lo
        x0, x1 = axis.x(lo), axis.x(hi)
        width = max(x1 - x0, 3.0)
        tip = f"{cls}: {fmt_num(stats.amin)} … {fmt_num(stats.amax)}"
        out.append(
            f'<rect class="{cls}" x="{n(x0)}" y="{n(y)}" width="{n(width)}" height="{n(h)}" '
            f'rx="{n(h / 2)}" fill="{colour}"><title>{esc(tip)}</title></rect>'
        )
    if stats.nonfinite:
        x = axis.x1 - 5
        cy = y + h / 2
        out.append(
            f'<path class="nonfinite-mark" d="M{n(x - 5)} {n(cy)} L{n(x)} {n(cy - 5)} '
            f'L{n(x + 5)} {n(cy)} L{n(x)} {n(cy + 5)} Z" fill="{BAD}"/>'
        )
    return out


def nonfinite_text(stats: TensorStats | None) -> str:
    if stats is None or not stats.nonfinite:
        return ""
    parts = []
    inf = stats.posinf + stats.neginf
    if inf:
        parts.append(f"{fmt_compact(inf)} inf")
    if stats.nan:
        parts.append(f"{fmt_compact(stats.nan)} nan")
    return " ".join(parts)


def range_chart(layers: Sequence[LayerStats], fmt: NumberFormat, culprit: str | None, *,
                failure: Failure | None = None) -> str:
    """One row per module (execution order): forward and backward amin..amax on a log2 axis.

    The culprit's row also shows the tensor that failed (``failure.stats``: a gradient of its
    input in a backward failure) on its phase's bar, with its non-finite count and name, when
    the module's own statistics do not already show non-finite values there."""
    width = 1100
    label_w, right_w = 260, 96
    head, row_h = 58, 28
    axis_values: list[float] = []
    for layer in layers:
        for s in (layer.forward, layer.backward):
            if s is not None:
                axis_values += [s.amax, s.amin]
    lo, hi = binade_domain(fmt, axis_values)
    axis = _Axis(lo, hi, label_w + 8, width - right_w)
    height = head + row_h * len(layers) + 28
    body_y0, body_y1 = head - 6, head + row_h * len(layers)
    # two SVGs at one scale: the names column stays put (CSS sticky) while a narrow window
    # scrolls the bars beside it, so a row is never a bar without its module's name
    names = [
        f'<svg class="range-names" viewBox="0 0 {label_w} {height}" '
        f'style="flex:{label_w} 1 0" aria-hidden="true" {_FONT}>',
        f'<rect x="0" y="0" width="{label_w}" height="{height}" fill="#ffffff"/>',
    ]
    parts = [
        f'<svg class="range-chart" viewBox="{label_w} 0 {width - label_w} '
        f'{height}" style="flex:{width - label_w} 1 0" role="img" aria-label="value ranges '
        f'per module against {esc(fmt.name)} limits" {_FONT}>',
        _DEFS,
    ]
    parts += _zones(axis, fmt, body_y0, body_y1)
    sub, norm, top = _limits(fmt)
    for a, b, text in ((lo, sub, "flushed to 0"), (sub, norm, "subnormal"), (top, hi, "overflow")):
        xa, xb = axis.x(a), axis.x(b)
        if xb - xa > 40:
            parts.append(
                f'<text x="{n((xa + xb) / 2)}" y="14" text-anchor="middle" fill="{MUTED}" '
                f'font-size="11" font-style="italic">{esc(text)}</text>'
            )
    parts += _limit_labels(axis, fmt, 30, left=label_w)  # inside the bars, not the names
    parts += _binade_ticks(axis, body_y0, body_y1, 47, 16)
    for i, layer in enumerate(layers):
        y = head + i * row_h
        is_culprit = bool(culprit) and layer.module == culprit
        cls = "range-row culprit" if is_culprit else "range-row"
        attrs = ' data-culprit="true"' if is_culprit else ""
        parts.append(f'<g class="{cls}" data-module="{esc(layer.module)}"{attrs}>')
        parts.append(f"<title>{esc(layer.module)} ({esc(layer.type)})</title>")
        if is_culprit:
            tint = (f'height="{row_h}" fill="{BAD}" fill-opacity="0.09" stroke="{BAD}" '
                    'stroke-opacity="0.5" rx="4"/>')
            parts.append(f'<rect x="{label_w - 8}" y="{n(y)}" width="{width - label_w + 8}" '
                         + tint)
            names.append(f'<rect x="0" y="{n(y)}" width="{label_w + 8}" ' + tint)
        elif i % 2:
            names.append(
                f'<rect x="0" y="{n(y)}" width="{label_w}" height="{row_h}" fill="#f8fafc"/>'
            )
        name = _short_name(layer.module or "(root)", 34)
        weight = ' font-weight="700"' if is_culprit else ""
        colour = BAD if is_culprit else INK
        names.append(
            f'<text x="8" y="{n(y + 18)}" font-size="12" fill="{colour}"{weight} '
            f'class="mono row-name" data-module="{esc(layer.module)}">{esc(name)}'
            f"<title>{esc(layer.module)} ({esc(layer.type)})</title></text>"
        )
        fwd, bwd = layer.forward, layer.backward
        failed = _failed_tensor(failure) if is_culprit else None
        if failed is not None:
            phase, stats, tensor = failed
            shown = fwd if phase == "forward" else bwd
            if shown is None or not shown.nonfinite:
                if phase == "forward":
                    fwd = stats
                else:
                    bwd = stats
                parts.append(f"<title>{esc(tensor)}: {esc(nonfinite_text(stats))}</title>")
        parts += _bar(axis, fwd, y + 6, 7, FWD, "forward")
        parts += _bar(axis, bwd, y + 15, 7, BWD, "backward")
        marks = [t for t in (nonfinite_text(fwd), nonfinite_text(bwd)) if t]
        if failed is not None and marks and (fwd is failed[1] or bwd is failed[1]):
            marks = [f"{nonfinite_text(failed[1])} in {failed[2]}"]
        if marks:
            parts.append(
                f'<text x="{n(axis.x1 + 8)}" y="{n(y + 18)}" font-size="11" fill="{BAD}" '
                f'font-weight="600">{esc(marks[0])}</text>'
            )
        parts.append("</g>")
    parts += _limit_lines(axis, fmt, body_y0, body_y1)
    if len(layers) > 14:
        parts += _binade_ticks(axis, body_y1, body_y1, body_y1 + 16, 16)
    parts.append("</svg>")
    names.append("</svg>")
    return '<div class="range-split">' + "".join(names) + "".join(parts) + "</div>"


def _failed_tensor(failure: Failure | None) -> tuple[str, TensorStats, str] | None:
    """(bar row, stats, tensor name) of the culprit's failing tensor, when it was recorded."""
    if failure is None or failure.stats is None or not failure.stats.nonfinite:
        return None
    if failure.phase == "data":
        return None
    row = "forward" if failure.phase == "forward" else "backward"
    return row, failure.stats, failure.tensor


def empty_chart(text: str, width: int = 520) -> str:
    """A chart-sized note where there is nothing to plot."""
    return (
        f'<svg class="chart empty" viewBox="0 0 {width} 60" width="100%">'
        f'<text x="{width // 2}" y="34" text-anchor="middle" fill="{MUTED}" '
        f'font-size="13">{esc(text)}</text></svg>'
    )


# ----------------------------------------------------------------------------- line charts


@dataclass(frozen=True)
class Series:
    """Points of one step-indexed series; ``None`` y is a gap, a non-finite y a red marker."""

    points: list[tuple[int, float | None]]
    colour: str = FWD
    step: bool = False  # draw as a step function (a loss scale)


def line_chart(
    series: Series,
    *,
    log: str = "",
    skipped: Iterable[int] = (),
    fail_step: int | None = None,
    limit: tuple[float, str] | None = None,
    width: int = 520,
    height: int = 190,
) -> str:
    """A small step-indexed chart; ``log`` is ``""``, ``"2"`` or ``"10"``."""
    ml, mr, mt, mb = 56, 14, 14, 26
    pts = thin(series.points)
    series = Series(pts, series.colour, series.step)
    steps = [s for s, _ in pts] or [0]
    finite = [v for _, v in pts if v is not None and math.isfinite(v) and (not log or v > 0)]
    values = list(finite)
    if limit is not None:
        values.append(limit[0])
    if not finite:
        return (
            f'<svg class="chart empty" viewBox="0 0 {width} 60" width="100%">'
            f'<text x="{width // 2}" y="34" '
            f'text-anchor="middle" fill="{MUTED}" font-size="13">no finite values recorded'
            "</text></svg>"
        )

    def tr(v: float) -> float:
        return math.log(v, int(log)) if log else v

    ys = [tr(v) for v in values]
    y_lo, y_hi = min(ys), max(ys)
    if log:
        y_lo, y_hi = math.floor(y_lo), math.ceil(y_hi)
        if y_hi - y_lo < 2:
            y_lo, y_hi = y_lo - 1, y_hi + 1
    else:
        if y_hi == y_lo:
            y_lo, y_hi = y_lo - 1, y_hi + 1
        pad = (y_hi - y_lo) * 0.08
        y_lo = 0.0 if y_lo >= 0 and y_lo - pad < 0 else y_lo - pad
        y_hi += pad
    x_lo, x_hi = min(steps), max(steps)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 0.5, x_hi + 0.5
    px0, px1, py0, py1 = ml, width - mr, mt, height - mb

    def to_x(s: float) -> float:
        return px0 + (s - x_lo) / (x_hi - x_lo) * (px1 - px0)

    def to_y(v: float) -> float:
        t = min(max(tr(v), y_lo), y_hi)
        return py1 - (t - y_lo) / (y_hi - y_lo) * (py1 - py0)

    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="100%" {_FONT}>']
    half = max((px1 - px0) / max(x_hi - x_lo, 1) / 2, 1.5)
    for s in _runs(sorted(set(skipped))):
        a, b = to_x(s[0]) - half, to_x(s[1]) + half
        out.append(
            f'<rect class="skipped" x="{n(max(a, px0))}" y="{py0}" '
            f'width="{n(min(b, px1) - max(a, px0))}" height="{py1 - py0}" fill="#fde68a" '
            f'fill-opacity="0.45"/>'
        )
    # y grid
    if log:
        span = y_hi - y_lo
        step = _tick_step(span, 5)
        k = math.ceil(y_lo / step) * step
        while k <= y_hi:
            y = py1 - (k - y_lo) / (y_hi - y_lo) * (py1 - py0)
            label = pow2_label(int(k)) if log == "2" else "10" + superscript(int(k))
            out += _ytick(px0, px1, y, label)
            k += step
    else:
        for t in nice_ticks(y_lo, y_hi, 4):
            out += _ytick(px0, px1, to_y(t), fmt_num(t))
    # x ticks
    xt = nice_ticks(x_lo, x_hi, min(8, max(int(x_hi - x_lo), 1)))
    for t in xt:
        if float(t).is_integer():
            out.append(
                f'<text x="{n(to_x(t))}" y="{height - 8}" text-anchor="middle" fill="{MUTED}" '
                f'font-size="11">{int(t)}</text>'
            )
    out.append(
        f'<line x1="{px0}" x2="{px1}" y1="{py1}" y2="{py1}" stroke="#cbd5e1" stroke-width="1"/>'
    )
    if limit is not None:
        y = n(to_y(limit[0]))
        out.append(
            f'<line class="limit-max" x1="{px0}" x2="{px1}" y1="{y}" y2="{y}" stroke="{BAD}" '
            f'stroke-width="1.5" stroke-dasharray="5 3"/>'
            f'<text x="{px1 - 2}" y="{n(to_y(limit[0]) - 4)}" text-anchor="end" fill="{BAD}" '
            f'font-size="11" font-weight="600">{esc(limit[1])}</text>'
        )
    if fail_step is not None and x_lo <= fail_step <= x_hi:
        x = n(to_x(fail_step))
        out.append(
            f'<line class="fail-step" x1="{x}" x2="{x}" y1="{py0}" y2="{py1}" stroke="{BAD}" '
            f'stroke-width="1.5" stroke-dasharray="3 3"/>'
        )
    out += _polyline(series, to_x, to_y, log)
    for s, v in pts:
        if v is not None and not math.isfinite(v):
            x, y = to_x(s), py0 + 6
            out.append(
                f'<g class="nonfinite-point"><title>step {s}: {esc(fmt_num(v))}</title>'
                f'<path d="M{n(x - 4)} {n(y - 4)} L{n(x + 4)} {n(y + 4)} M{n(x + 4)} {n(y - 4)} '
                f'L{n(x - 4)} {n(y + 4)}" stroke="{BAD}" stroke-width="2"/></g>'
            )
    out.append("</svg>")
    return "".join(out)


#: one colour per rank, cycled; no red, which marks non-finite values
RANK_COLOURS = (
    "#2563eb", "#d97706", "#059669", "#7c3aed", "#db2777",
    "#0891b2", "#65a30d", "#475569", "#ea580c", "#4f46e5",
)  # fmt: skip


def rank_colour(i: int) -> str:
    return RANK_COLOURS[i % len(RANK_COLOURS)]


def multi_line_chart(
    series: Sequence[tuple[str, Series]],
    *,
    fail_step: int | None = None,
    width: int = 1100,
    height: int = 220,
) -> str:
    """Several step-indexed series on one linear axis, one ``<g class="rank-series">`` (a
    polyline per finite run, non-finite values as crosses in its colour) per labelled series."""
    ml, mr, mt, mb = 56, 14, 14, 26
    thinned = [(label, Series(thin(s.points), s.colour, s.step)) for label, s in series]
    all_pts = [p for _, s in thinned for p in s.points]
    finite = [v for _, v in all_pts if v is not None and math.isfinite(v)]
    if not finite:
        return (
            f'<svg class="chart multi empty" viewBox="0 0 {width} 60" width="100%">'
            f'<text x="{width // 2}" y="34" '
            f'text-anchor="middle" fill="{MUTED}" font-size="13">no finite values recorded'
            "</text></svg>"
        )
    y_lo, y_hi = min(finite), max(finite)
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - 1, y_hi + 1
    pad = (y_hi - y_lo) * 0.08
    y_lo = 0.0 if y_lo >= 0 and y_lo - pad < 0 else y_lo - pad
    y_hi += pad
    steps = [st for st, _ in all_pts] or [0]
    x_lo, x_hi = min(steps), max(steps)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 0.5, x_hi + 0.5
    px0, px1, py0, py1 = ml, width - mr, mt, height - mb

    def to_x(st: float) -> float:
        return px0 + (st - x_lo) / (x_hi - x_lo) * (px1 - px0)

    def to_y(v: float) -> float:
        t = min(max(v, y_lo), y_hi)
        return py1 - (t - y_lo) / (y_hi - y_lo) * (py1 - py0)

    out = [f'<svg class="chart multi" viewBox="0 0 {width} {height}" width="100%" {_FONT}>']
    for t in nice_ticks(y_lo, y_hi, 4):
        out += _ytick(px0, px1, to_y(t), fmt_num(t))
    for t in nice_ticks(x_lo, x_hi, min(10, max(int(x_hi - x_lo), 1))):
        if float(t).is_integer():
            out.append(
                f'<text x="{n(to_x(t))}" y="{height - 8}" text-anchor="middle" fill="{MUTED}" '
                f'font-size="11">{int(t)}</text>'
            )
    out.append(
        f'<line x1="{px0}" x2="{px1}" y1="{py1}" y2="{py1}" stroke="#cbd5e1" stroke-width="1"/>'
    )
    if fail_step is not None and x_lo <= fail_step <= x_hi:
        x = n(to_x(fail_step))
        out.append(
            f'<line class="fail-step" x1="{x}" x2="{x}" y1="{py0}" y2="{py1}" stroke="{BAD}" '
            f'stroke-width="1.5" stroke-dasharray="3 3"/>'
        )
    for i, (label, s) in enumerate(thinned):
        out.append(f'<g class="rank-series" data-label="{esc(label)}"><title>{esc(label)}</title>')
        out += _polyline(s, to_x, to_y, "")
        for st, v in s.points:
            if v is not None and not math.isfinite(v):
                x, y = to_x(st), py0 + 6 + 9 * min(i, 6)
                out.append(
                    f'<path class="nonfinite-point" d="M{n(x - 4)} {n(y - 4)} L{n(x + 4)} '
                    f'{n(y + 4)} M{n(x + 4)} {n(y - 4)} L{n(x - 4)} {n(y + 4)}" '
                    f'stroke="{s.colour}" stroke-width="2"><title>{esc(label)}, step {st}: '
                    f"{esc(fmt_num(v))}</title></path>"
                )
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def thin(
    points: list[tuple[int, float | None]], limit: int = 1200
) -> list[tuple[int, float | None]]:
    """At most about ``limit`` points that keep the shape: each bucket's lowest and highest value,
    and its first gap or non-finite value (so markers and breaks survive)."""
    if len(points) <= limit:
        return points
    size = math.ceil(len(points) / (limit / 2))
    keep: list[int] = []
    for start in range(0, len(points), size):
        idx = range(start, min(start + size, len(points)))
        finite = [i for i in idx if points[i][1] is not None and math.isfinite(points[i][1])]
        other = [i for i in idx if i not in finite]
        chosen = set(other[:1])
        if finite:
            chosen.add(min(finite, key=lambda i: points[i][1]))
            chosen.add(max(finite, key=lambda i: points[i][1]))
        keep += sorted(chosen)
    return [points[i] for i in keep]


def _ytick(px0: float, px1: float, y: float, label: str) -> list[str]:
    return [
        f'<line x1="{px0}" x2="{px1}" y1="{n(y)}" y2="{n(y)}" stroke="{GRID}"/>',
        f'<text x="{px0 - 6}" y="{n(y + 4)}" text-anchor="end" fill="{MUTED}" '
        f'font-size="11">{esc(label)}</text>',
    ]


def _runs(values: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive integers grouped: [1, 2, 3, 7] -> [(1, 3), (7, 7)]."""
    out: list[tuple[int, int]] = []
    for v in values:
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out


def _polyline(
    series: Series, to_x: Callable[[float], float], to_y: Callable[[float], float], log: str
) -> list[str]:
    segments: list[list[tuple[float, float]]] = [[]]
    prev_y: float | None = None
    for s, v in series.points:
        if v is None or not math.isfinite(v) or (log and v <= 0):
            if segments[-1]:
                segments.append([])
            prev_y = None
            continue
        x, y = to_x(s), to_y(v)
        if series.step and prev_y is not None:
            segments[-1].append((x, prev_y))
        segments[-1].append((x, y))
        prev_y = y
    out = []
    for seg in segments:
        if not seg:
            continue
        coords = " ".join(f"{n(x)},{n(y)}" for x, y in seg)
        out.append(
            f'<polyline points="{coords}" fill="none" stroke="{series.colour}" '
            f'stroke-width="2" stroke-linejoin="round"/>'
        )
        if len(series.points) <= 60:
            out += [
                f'<circle cx="{n(x)}" cy="{n(y)}" r="3" fill="#fff" stroke="{series.colour}" '
                f'stroke-width="1.5"/>'
                for x, y in seg
            ]
    return out


# ----------------------------------------------------------------------------- histogram


def histogram_chart(
    hist: dict[int, int],
    fmt: NumberFormat,
    *,
    nonfinite: int = 0,
    nonfinite_title: str = "",
    shift: int | None = None,
    shift_label: str = "",
) -> str:
    """An exponent histogram (binade -> count, log count axis) against the target's window.

    ``nonfinite`` values get their own bar at the right. ``shift`` also outlines the histogram
    moved by that many binades (the gradients multiplied by a loss scale of ``2**shift``).
    """
    width, height = 1100, 250
    ml, mr, mt, mb = 56, 110, 40, 30
    keys = sorted(k for k, c in hist.items() if c > 0)
    span = [*keys, *(k + 1 for k in keys)]
    if shift is not None:
        span += [k + shift for k in span]
    lo, hi = binade_domain(fmt, [2.0**k for k in span], pad=1)
    axis = _Axis(lo, hi, ml, width - mr)
    py0, py1 = mt, height - mb
    top = max(math.ceil(math.log10(1 + max([*(hist[k] for k in keys), nonfinite, 1]))), 1)

    def to_y(c: float) -> float:
        return py1 - math.log10(1 + c) / top * (py1 - py0)

    out = [
        f'<svg class="hist-chart" viewBox="0 0 {width} '
        f'{height}" width="100%" role="img" aria-label="exponent histogram" {_FONT}>',
        _DEFS,
    ]
    out += _zones(axis, fmt, py0, py1)
    for k in range(top + 1):
        label = "0" if k == 0 else ("10" if k == 1 else "10" + superscript(k))
        out += _ytick(ml, width - mr, to_y(10**k - 1 if k else 0), label)
    out += _binade_ticks(axis, py1, py1 + 4, height - 10, 20)
    bw = (axis.x1 - axis.x0) / (hi - lo)
    for k in keys:
        c = hist[k]
        x, y = axis.x(k), to_y(c)
        if k > fmt.max_binade:
            colour = BAD
        elif k >= fmt.min_normal_binade:
            colour = FWD
        elif k >= fmt.min_subnormal_binade:
            colour = "#d97706"
        else:
            colour = "#94a3b8"
        out.append(
            f'<rect class="hist-bar" x="{n(x + 0.5)}" y="{n(y)}" width="{n(max(bw - 1, 1))}" '
            f'height="{n(py1 - y)}" fill="{colour}"><title>[{esc(pow2_label(k))}, '
            f"{esc(pow2_label(k + 1))}): {c:,}</title></rect>"
        )
    if shift is not None and keys:
        d = []
        for k in keys:
            x0, x1, y = axis.x(k + shift), axis.x(k + shift + 1), to_y(hist[k])
            d.append(f"M{n(x0)} {n(py1)} V{n(y)} H{n(x1)} V{n(py1)}")
        out.append(
            f'<path class="hist-shifted" d="{" ".join(d)}" fill="none" stroke="#7c3aed" '
            f'stroke-width="1.5"/>'
        )
        if shift_label:
            peak = max(keys, key=lambda k: hist[k])
            x = (axis.x(peak + shift) + axis.x(peak + shift + 1)) / 2
            out.append(
                f'<text x="{n(x)}" y="{n(to_y(hist[peak]) - 6)}" text-anchor="middle" '
                f'fill="#7c3aed" font-size="11" font-weight="600">{esc(shift_label)}</text>'
            )
    if nonfinite:
        x = width - mr + 30
        y = to_y(nonfinite)
        out.append(
            f'<rect class="hist-nonfinite" x="{n(x)}" y="{n(y)}" width="28" '
            f'height="{n(py1 - y)}" fill="{BAD}"><title>{esc(nonfinite_title)}</title></rect>'
            f'<text x="{n(x + 14)}" y="{height - 10}" text-anchor="middle" fill="{BAD}" '
            f'font-size="11" font-weight="600">inf/nan</text>'
            f'<text x="{n(x + 14)}" y="{n(y - 5)}" text-anchor="middle" fill="{BAD}" '
            f'font-size="11">{esc(fmt_compact(nonfinite))}</text>'
        )
    out += _limit_lines(axis, fmt, py0 - 6, py1)
    out += _limit_labels(axis, fmt, py0 - 12, left=ml - 40)
    out.append("</svg>")
    return "".join(out)
