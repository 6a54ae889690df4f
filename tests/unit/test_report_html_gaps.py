"""HTML gaps: a backward culprit's row shows its failing gradient, a run with no GradScaler says
so, and the headline sentence is said once."""

from __future__ import annotations

import html
import re

from nanhunt.report import render_html
from nanhunt.report._example import example_trace
from nanhunt.trace import Failure, StepRecord, TensorStats, Trace


def _culprit_row(page: str) -> str:
    m = re.search(r'<g class="range-row culprit"[^>]*>(.*?)</g>', page, re.S)
    assert m, "no culprit row"
    return m.group(1)


def _backward_failure(trace: Trace, *, grad_output_stats: bool) -> Trace:
    name = trace.first_failure.module
    layer = next(ly for ly in trace.layers if ly.module == name)
    layer.forward.nan = layer.forward.posinf = layer.forward.overflow = 0
    layer.forward.amax = 30.0
    if not grad_output_stats:
        layer.backward = None  # nothing recorded for the gradient of its output
    else:
        layer.backward.nan = layer.backward.posinf = layer.backward.overflow = 0
    bad = TensorStats(dtype="float32", shape=[16, 32], numel=512, nan=32, overflow=32,
                      amax=0.0317, amin=3.9e-6)
    trace.first_failure = Failure(step=2, phase="backward", module=name, tensor="grad_input[0]",
                                  stats=bad, op="aten.div")
    return trace


def test_a_backward_culprit_row_shows_its_failing_gradient():
    for grad_output_stats in (True, False):
        trace = _backward_failure(example_trace(), grad_output_stats=grad_output_stats)
        row = _culprit_row(render_html(trace))
        assert 'class="backward' in row  # a backward bar: the failing gradient's range
        assert "nonfinite-mark" in row
        assert "32 nan in grad_input[0]" in row


def test_no_scaler_is_said_not_charted_as_missing_values():
    trace = example_trace()
    trace.run.scaler = False
    for s in trace.steps:
        s.scale = None
    page = render_html(trace)
    assert "no finite values recorded" not in page
    assert "No GradScaler in this run" in page


def test_a_scaler_whose_scale_went_non_finite_is_still_charted():
    trace = example_trace()
    assert trace.run.scaler
    page = render_html(trace)
    assert "No GradScaler in this run" not in page


def test_the_headline_sentence_is_shown_once():
    trace = example_trace()
    page = render_html(trace)
    body = re.sub(r"<script.*?</script>|<style.*?</style>|<title>.*?</title>", "", page,
                  flags=re.S)
    body = html.unescape(re.sub(r"<[^>]+>", "", body))
    message = trace.diagnosis.message
    assert len(message) > 40
    assert body.count(message) == 1, message


def test_steps_without_a_scale_value_but_a_scaler_keep_the_chart():
    trace = Trace(steps=[StepRecord(0, loss=1.0, scale=1024.0), StepRecord(1, loss=1.0,
                                                                            scale=512.0)])
    trace.run.scaler = True
    page = render_html(trace)
    assert "No GradScaler in this run" not in page
