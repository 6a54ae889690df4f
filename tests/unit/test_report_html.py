"""The self-contained HTML report: well-formed, offline, escaped, and the range chart is right."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from nanhunt.report import render_html
from nanhunt.report._example import example_trace
from nanhunt.trace import (
    Failure,
    Finding,
    LayerStats,
    OpRecord,
    RankSummary,
    Recommendation,
    RunInfo,
    StepRecord,
    TensorStats,
    Trace,
)

EVIL = "</script><script>alert(1)</script>"

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}  # fmt: skip
# SVG elements written self-closing (<rect/>) arrive through handle_startendtag


class Page(HTMLParser):
    """Checks nesting and collects what the tests look at."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self.text: list[str] = []
        self._script: dict[str, str | None] | None = None

    def handle_starttag(self, tag, attrs):
        attrs_d = dict(attrs)
        self.tags.append((tag, attrs_d))
        if tag == "script":
            self._script = attrs_d
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
            return
        self.stack.pop()

    def handle_data(self, data):
        if self._script is not None and self.stack and self.stack[-1] == "script":
            self.scripts.append((self._script, data))
            self._script = None
        else:
            self.text.append(data)

    def with_class(self, tag: str, cls: str) -> list[dict[str, str | None]]:
        return [a for t, a in self.tags if t == tag and cls in (a.get("class") or "").split()]


def parse(page: str) -> Page:
    p = Page()
    p.feed(page)
    p.close()
    assert p.errors == []
    assert p.stack == []
    return p


def island(p: Page) -> dict:
    (data,) = [text for attrs, text in p.scripts if attrs.get("id") == "nanhunt-data"]
    return json.loads(data)


def stats(amax: float, amin: float = 1e-3, **kw) -> TensorStats:
    return TensorStats(dtype="float16", shape=[2], numel=100, amax=amax, amin=amin, **kw)


def evil_trace() -> Trace:
    trace = example_trace()
    trace.layers[3].module = EVIL
    trace.first_failure.module = EVIL
    trace.first_failure.source_line = f"x = '{EVIL}' & <b>"
    trace.diagnosis.message = EVIL
    trace.diagnosis.evidence.append(EVIL)
    trace.warnings[0].module = EVIL
    trace.recommendations[0].snippet = f"print('{EVIL}')"
    trace.facts.append(EVIL)
    trace.ops[0].source = EVIL
    trace.run.error = f"RuntimeError: {EVIL}"
    trace.run.status = "crashed"
    trace.run.script = EVIL
    return trace


# ----------------------------------------------------------------------------- structure


def test_page_is_well_formed_and_complete():
    page = render_html(example_trace())
    assert page.startswith("<!doctype html>")
    p = parse(page)
    ids = {a.get("id") for _, a in p.tags}
    for section in ("verdict", "failure", "diagnosis", "ranges", "recommendations", "timeline",
                    "histogram", "modules", "warnings", "facts", "ops", "run"):  # fmt: skip
        assert section in ids, section
    (verdict,) = [a for t, a in p.tags if a.get("id") == "verdict"]
    assert verdict["data-level"] == "problem"
    text = " ".join(p.text)
    assert "PROBLEM: overflow in forward at step 3, module encoder.blocks.1.ffn.wo" in text
    assert "return self.wo(self.dropout(self.act(self.wi(x))))" in "".join(p.text)


def test_no_remote_resources():
    page = render_html(evil_trace())
    p = parse(page)
    for tag, attrs in p.tags:
        for name in ("src", "href", "xlink:href", "action", "poster"):
            value = (attrs.get(name) or "").strip().lower()
            assert not value.startswith(("http:", "https:", "//")), (tag, name, value)
        assert tag not in ("link", "iframe", "img", "object", "embed")
    assert not re.search(r"""\b(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "@import" not in page
    assert "http" not in render_html(example_trace())  # not even an xmlns
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", page, re.I)


def test_json_island_round_trips():
    trace = example_trace()
    data = island(parse(render_html(trace)))
    assert Trace.from_dict(data).to_dict() == trace.to_dict()
    assert data["steps"][3]["loss"] == "nan"


def test_user_strings_cannot_break_out():
    trace = evil_trace()
    page = render_html(trace)
    assert "<script>alert(1)" not in page
    assert page.count("<script") == 2  # the data island and the page's own script
    p = parse(page)
    data = island(p)
    assert data["first_failure"]["module"] == EVIL
    assert Trace.from_dict(data).to_dict() == trace.to_dict()
    text = "".join(p.text)
    assert EVIL in text  # shown to the reader as text
    (culprit,) = p.with_class("g", "culprit")
    assert culprit["data-module"] == EVIL


def test_island_escapes_markup_characters():
    trace = Trace(facts=["a <b> & c\u2028"])
    page = render_html(trace)
    raw = page.split('id="nanhunt-data">', 1)[1].split("</script>", 1)[0]
    assert "<" not in raw
    assert ">" not in raw
    assert "&" not in raw
    assert "\\u003cb\\u003e \\u0026 c\\u2028" in raw


# ----------------------------------------------------------------------------- charts


def test_range_chart_has_one_row_per_module_and_marks_the_culprit():
    trace = example_trace()
    p = parse(render_html(trace))
    rows = p.with_class("g", "range-row")
    assert [r["data-module"] for r in rows] == [ly.module for ly in trace.layers]
    culprits = [r for r in rows if "culprit" in (r.get("class") or "").split()]
    assert [r["data-module"] for r in culprits] == ["encoder.blocks.1.ffn.wo"]
    assert culprits[0]["data-culprit"] == "true"
    assert len(p.with_class("rect", "forward")) == len(trace.layers)
    assert len(p.with_class("rect", "backward")) == len(trace.layers)
    # 42 inf in the culprit, nan in the two modules after it
    assert len(p.with_class("path", "nonfinite-mark")) == 3


def test_range_chart_draws_target_limits_in_order():
    p = parse(render_html(example_trace()))
    (svg,) = p.with_class("svg", "range-chart")
    assert svg.get("viewbox") or svg.get("viewBox")

    def x_of(cls: str) -> float:
        lines = [a for t, a in p.tags if t == "line" and a.get("class") == cls]
        return float(lines[0]["x1"])

    sub, norm, top = x_of("limit-subnormal"), x_of("limit-normal"), x_of("limit-max")
    assert sub < norm < top
    # fp16: 10 binades from 2^-24 to 2^-14, ~30 from 2^-14 to 65504
    assert (top - norm) / (norm - sub) == pytest.approx(math.log2(65504 / 2**-14) / 10, rel=0.01)
    for zone in ("zone-flush", "zone-subnormal", "zone-overflow"):
        assert p.with_class("rect", zone)


def test_bars_sit_where_their_values_are():
    trace = Trace(layers=[LayerStats("a", "Linear", forward=stats(2.0**10, 2.0**-4))])
    p = parse(render_html(trace))
    (bar,) = p.with_class("rect", "forward")
    norm = float(next(a for t, a in p.tags if a.get("class") == "limit-normal")["x1"])
    top = float(next(a for t, a in p.tags if a.get("class") == "limit-max")["x1"])
    per_binade = (top - norm) / math.log2(65504 / 2**-14)
    x0 = float(bar["x"])
    assert x0 == pytest.approx(norm + 10 * per_binade, abs=0.2)  # 2^-4 is 10 binades above 2^-14
    assert float(bar["width"]) == pytest.approx(14 * per_binade, abs=0.2)


def test_histogram_has_a_bar_per_binade():
    trace = example_trace()
    trace.grad_hist = {}
    p = parse(render_html(trace))
    bars = p.with_class("rect", "hist-bar")
    assert len(bars) == sum(1 for c in trace.first_failure.stats.hist.values() if c > 0)
    assert p.with_class("rect", "hist-nonfinite")


def test_timeline_marks_skipped_steps_and_failure():
    p = parse(render_html(example_trace()))
    assert p.with_class("rect", "skipped")
    assert p.with_class("line", "fail-step")
    assert p.with_class("g", "nonfinite-point")  # nan losses
    figures = p.with_class("figure", "mini")
    assert len(figures) == 4  # loss, scale, grad norm, culprit amax


def svg_numbers(page: str) -> list[str]:
    return re.findall(r'\s(?:x|y|x1|x2|y1|y2|width|height|cx|cy|r|rx)="([^"]*)"', page)


def test_non_finite_and_missing_values_render_gracefully():
    weird = stats(math.inf, math.inf, nan=3, headroom=math.nan)
    trace = Trace(
        layers=[
            LayerStats("empty", "Identity"),
            LayerStats("weird", "Linear", forward=weird, backward=stats(0.0, math.inf)),
            LayerStats("tiny", "Linear", forward=stats(1e-44, 1e-45)),
            LayerStats("huge", "Linear", forward=stats(1e38, 1.0)),
        ],
        steps=[
            StepRecord(0, loss=math.nan, scale=None, grad_norm=math.inf),
            StepRecord(1, loss=math.inf, scale=0.0, skipped=True),
        ],
        first_failure=Failure(1, "forward", "weird", "output", weird),
        ops=[OpRecord(0, "aten::mul", "forward", "float32", math.nan, 1, 1)],
        recommendations=[Recommendation("fix_data", None, "")],
        run=RunInfo(target="float99"),
    )
    page = render_html(trace)
    p = parse(page)
    assert len(p.with_class("g", "range-row")) == 4
    for value in svg_numbers(page):
        assert math.isfinite(float(value.rstrip("%"))), value
    assert "no finite values recorded" in page


def test_empty_trace():
    page = render_html(Trace())
    p = parse(page)
    (verdict,) = [a for t, a in p.tags if a.get("id") == "verdict"]
    assert verdict["data-level"] == "partial"  # nothing was checked: no OK verdict
    assert "the script exited before any training step" in page
    assert "OK: no non-finite values" not in page
    assert "No module statistics were recorded." in page
    assert not p.with_class("g", "range-row")


def test_single_step_and_ok_run():
    trace = Trace(
        steps=[StepRecord(0, loss=2.0, scale=65536.0, grad_norm=1.0)],
        layers=[LayerStats("fc", "Linear", forward=stats(3.0), backward=stats(0.5))],
        warnings=[Finding("near", "overflow", "warning", "close", module="fc", score=1.0)],
    )
    page = render_html(trace)
    p = parse(page)
    assert "OK: no non-finite values; 1 warning" in page
    assert not p.with_class("g", "culprit")
    for value in svg_numbers(page):
        assert math.isfinite(float(value.rstrip("%"))), value


# ----------------------------------------------------------------------------- content


def test_recommendations_have_copyable_snippets():
    trace = example_trace()
    p = parse(render_html(trace))
    assert len(p.with_class("button", "copy")) == len(trace.recommendations)
    text = "".join(p.text)
    for rec in trace.recommendations:
        assert rec.snippet in text  # highlighting adds spans, never changes the text
    assert "✓ verified by re-run" in text
    assert "✗ not verified" in text
    assert "--fix 'fp32:encoder.blocks.*.ffn.wo..norm'" in text


def test_modules_table_is_worst_first_and_ops_table_marks_first_nonfinite():
    trace = example_trace()
    page = render_html(trace)
    p = parse(page)
    rows = [a for t, a in p.tags if t == "tr" and a.get("data-order") is not None]
    assert len(rows) == len(trace.layers)
    assert "culprit" in rows[0]["class"].split()
    assert "first non-finite" in page


def test_partial_run_banner():
    trace = example_trace()
    trace.run.status = "crashed"
    trace.run.error = "Traceback (most recent call last):\nRuntimeError: CUDA error"
    page = render_html(trace)
    assert "PARTIAL REPORT (script crashed: RuntimeError: CUDA error)" in page
    assert '<pre class="error">Traceback (most recent call last):' in page


# ----------------------------------------------------------------------------- browser

CHROMIUM = shutil.which("chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium")
def test_headless_browser_renders_the_page(tmp_path: Path):
    report = tmp_path / "report.html"
    report.write_text(render_html(evil_trace()), encoding="utf-8")
    png = tmp_path / "shot.png"
    profile = tmp_path / "profile"
    assert CHROMIUM is not None
    shot = [f"--screenshot={png}", "--window-size=1280,2000"]
    subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *shot, report.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 50_000  # a blank 1280x2000 page compresses to a few KB

    dom = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", report.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert 'data-js="ready"' in dom  # the script parsed the island and ran to the end
    assert 'id="verdict"' in dom
    assert "PROBLEM: overflow in forward at step 3" in dom
    assert "<script>alert(1)" not in dom


def test_gradient_histograms_notes_and_bad_samples():
    trace = example_trace()
    trace.first_failure.bad_samples = {"input[0]": list(range(20))}
    trace.notes = ["replaying culprit-step3.pt raised RuntimeError: <oops>"]
    page = render_html(trace)
    p = parse(page)
    ids = {a.get("id") for _, a in p.tags}
    assert {"gradients", "notes"} <= ids
    (hist,) = trace.grad_hist.values()
    charts = p.with_class("svg", "hist-chart")
    assert len(charts) == 2  # the culprit's and the gradients'
    bars = p.with_class("rect", "hist-bar")
    assert len(bars) == len(trace.first_failure.stats.hist) + len(hist)
    assert p.with_class("path", "hist-shifted")  # moved by the first loss scale, 2^16
    assert "× loss scale 2¹⁶" in page
    assert "Samples with non-finite values: input[0]: 0, 1, 2, 3, 4, 5, 6, 7 (+12 more)" in page
    assert "RuntimeError: &lt;oops&gt;" in page


def test_long_runs_stay_small():
    trace = example_trace()
    trace.steps = [
        StepRecord(i, loss=2.0 + (i % 50) / 10, scale=2.0**14, skipped=i % 500 == 7, grad_norm=1.0)
        for i in range(20_000)
    ]
    trace.steps[12_345].loss = math.nan
    page = render_html(trace)
    p = parse(page)
    polylines = [a["points"] for t, a in p.tags if t == "polyline"]
    assert all(len(pts.split()) <= 2_500 for pts in polylines)
    assert p.with_class("g", "nonfinite-point")  # the one nan loss survives thinning
    assert len([a for t, a in p.tags if t == "tr" and a.get("class") == "gap"]) > 0
    assert "of 20000 steps (the rest are in the JSON)" in page
    assert len(page) < 4_000_000  # the JSON island holds every step; the markup does not


# ----------------------------------------------------------------------------- ranks


def rank_steps(n: int, fail: int | None = None, loss: float = 2.0) -> list[StepRecord]:
    return [
        StepRecord(i, loss=math.nan if i == fail else loss + i, scale=2.0**16, skipped=i == fail,
                   grad_norm=1.0, nonfinite=i == fail)
        for i in range(n)
    ]  # fmt: skip


def multi_rank_trace() -> Trace:
    """Three ranks: rank 1 failed first, rank 0 crashed after it, rank 2 never answered."""
    ff = Failure(2, "data", "model", "input[0]", stats(1.0, nan=1), rank=1)
    return Trace(
        run=RunInfo(world_size=3, status="crashed", error="rank 0: RuntimeError: boom"),
        steps=rank_steps(3, fail=2),
        first_failure=ff,
        problem=True,
        ranks=[
            RankSummary(0, steps=rank_steps(4, loss=5.0), status="crashed",
                        error=f"Traceback ...\nRuntimeError: {EVIL}"),
            RankSummary(1, first_failure=ff, steps=rank_steps(3, fail=2), status="stopped"),
            RankSummary(2, answered=False, status="no answer"),
        ],
    )  # fmt: skip


def test_verdict_names_the_failing_rank():
    p = parse(render_html(multi_rank_trace()))
    (h1,) = [t for t in p.text if t.startswith("PROBLEM:")]
    assert h1 == "PROBLEM: non-finite value in data at step 2, module model on rank 1"


def test_verdict_says_every_rank_when_all_failed_alike():
    trace = multi_rank_trace()
    trace.run.world_size = 2
    trace.all_ranks_failed = True
    trace.ranks = [
        RankSummary(r, first_failure=trace.first_failure, steps=rank_steps(3, 2)) for r in range(2)
    ]
    page = render_html(trace)
    assert "module model on every rank (2 of 2)</h1>" in page
    assert "Every rank failed alike" in page


def test_ranks_section_has_a_row_a_loss_line_and_a_step_table_per_rank():
    trace = multi_rank_trace()
    page = render_html(trace)
    assert "<script>alert(1)" not in page
    p = parse(page)
    rows = [a for t, a in p.tags if t == "tr" and "data-rank" in a]
    assert [a["data-rank"] for a in rows] == ["0", "1", "2"]
    assert "culprit" in (rows[1].get("class") or "")  # the origin
    text = " ".join(p.text)
    assert "no answer" in text
    assert f"RuntimeError: {EVIL}" in text  # the crashed rank's error, as text
    # one line per rank that sent steps, labelled, with a legend entry each
    series = p.with_class("g", "rank-series")
    assert [a["data-label"] for a in series] == ["rank 0", "rank 1"]
    chart = page.split('<svg class="chart multi"', 1)[1].split("</svg>", 1)[0]
    groups = chart.split('<g class="rank-series"')[1:]
    assert all(g.count("<polyline") == 1 for g in groups)
    assert 'class="nonfinite-point"' in groups[1]  # rank 1's nan loss at step 2
    assert "rank 0</span>" in page
    assert "rank 1</span>" in page
    details = p.with_class("details", "rank-steps")
    assert [a["data-rank"] for a in details] == ["0", "1"]
    assert "rank 0 · 4 steps · no non-finite values · crashed" in text
    assert "rank 1 · 3 steps · first failure at step 2" in text
    rank0 = page.split('data-rank="0"><summary>', 1)[1].split("</details>", 1)[0]
    assert rank0.count("<tr") == 5  # a header and rank 0's own four steps
    assert '<td class="num">8</td>' in rank0  # its own loss at step 3 (5 + 3)


def test_ranks_of_an_old_report_still_render():
    trace = multi_rank_trace()
    data = trace.to_dict()
    for r in data["ranks"]:
        del r["status"], r["error"]
    del data["all_ranks_failed"]
    back = Trace.from_dict(data)
    assert [r.status for r in back.ranks] == ["complete"] * 3
    page = render_html(back)
    parse(page)
    assert page.count('class="badge ok">answered<') == 2
    assert 'class="badge warn">no answer<' in page
