"""The HTML report in a phone-sized window: the headline breaks between name parts, never
inside one, and the range chart opens on the culprit and the max line, not the subnormal zone."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from nanhunt.report import render_html
from nanhunt.report._example import example_trace

CHROMIUM = shutil.which("chromium")


def test_the_headline_breaks_only_between_name_parts():
    page = render_html(example_trace())
    h1 = re.search(r"<h1>(.*?)</h1>", page).group(1)
    assert "encoder.<wbr>blocks.<wbr>1.<wbr>ffn.<wbr>wo" in h1
    css = re.search(r"\.verdict h1\{[^}]*\}", page).group(0)
    assert "anywhere" not in css  # no break inside "ffn.wo" → "ffn.w" / "o"


def test_numbers_keep_their_dot():
    from nanhunt.report.html import _breakable

    assert _breakable("amax 6.55e+04 in model.layers.10.mlp") == \
        "amax 6.55e+04 in model.<wbr>layers.<wbr>10.<wbr>mlp"


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium")
@pytest.mark.parametrize("width", [400, 1280])
def test_the_range_chart_opens_on_the_culprit(tmp_path: Path, width: int):
    report = tmp_path / "report.html"
    report.write_text(render_html(example_trace()), encoding="utf-8")
    assert CHROMIUM is not None
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", f"--user-data-dir={tmp_path / 'profile'}",
         f"--window-size={width},2000", "--dump-dom", "--virtual-time-budget=2000",
         report.as_uri()],
        capture_output=True, text=True, timeout=120, check=True)
    wraps = re.findall(r'<div class="chart-wrap"( data-scrolled="(\d+)")?>\s*'
                       r'<div class="range-split">\s*<svg class="range', proc.stdout)
    assert wraps, proc.stdout[:500]
    scrolled = wraps[0][1]
    if width == 400:  # the chart is wider than the window: it opened scrolled right
        assert scrolled and int(scrolled) > 100
    else:  # it fits: nothing to scroll
        assert not scrolled


def test_module_names_in_tables_break_between_parts():
    page = render_html(example_trace())
    assert '">▶ encoder.<wbr>blocks.<wbr>1.<wbr>ffn.<wbr>wo</td>' in page
    css = re.search(r"table\.data td\.mono\{[^}]*\}", page).group(0)
    assert "anywhere" not in css  # "final_norm" never becomes "final_no" / "rm"


def test_the_range_chart_keeps_its_module_names_in_their_own_column():
    """The names are a separate SVG at the bars' scale, sticky on the left of the scrolling
    chart: a narrow window scrolls the bars, never the names away."""
    trace = example_trace()
    page = render_html(trace)
    names = re.search(r'<svg class="range-names"[^>]*>(.*?)</svg>', page, re.S)
    assert names, "no names column"
    shown = re.findall(r'data-module="([^"]*)"', names.group(1))
    assert shown == [ly.module for ly in trace.layers]
    bars = re.search(r'<svg class="range-chart"[^>]*>(.*?)</svg>', page, re.S).group(1)
    assert 'class="mono row-name"' not in bars
    css = re.search(r"\.range-names\{[^}]*\}", page).group(0)
    assert "position:sticky" in css and "left:0" in css


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium")
@pytest.mark.parametrize("width", [400, 1280])
def test_the_module_names_stay_in_view(tmp_path: Path, width: int):
    # the report as it is, plus a probe that writes where the names column and the chart's
    # scroll box sit once the page has settled (the report's own script runs first)
    probe = ("<script>setTimeout(function () {var w = document.querySelector('.chart-wrap');"
             "var n = w.querySelector('.range-names'); var b = w.getBoundingClientRect();"
             "var r = n.getBoundingClientRect(); document.body.setAttribute('data-probe',"
             " [Math.round(r.left - b.left), Math.round(r.width), w.scrollLeft].join(','));"
             "}, 500);</script>")
    report = tmp_path / "report.html"
    report.write_text(render_html(example_trace()).replace("</body>", probe + "</body>"),
                      encoding="utf-8")
    assert CHROMIUM is not None
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", f"--user-data-dir={tmp_path / 'profile'}",
         f"--window-size={width},2000", "--dump-dom", "--virtual-time-budget=2000",
         report.as_uri()],
        capture_output=True, text=True, timeout=120, check=True)
    left, names_width, scrolled = map(int, re.search(r'data-probe="([^"]+)"',
                                                     proc.stdout).group(1).split(","))
    assert names_width > 40  # the names column is there, readable
    assert left == 0  # at the scroll box's left edge, however far the bars scrolled
    if width == 400:
        assert scrolled > 100
