"""The 80-column terminal tables: every number whole, the folded-steps row in its columns."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from nanhunt.report import render_terminal
from nanhunt.report._example import example_trace
from nanhunt.trace import LayerStats, RunInfo, StepRecord, TensorStats, Trace


def _render(trace: Trace, width: int = 80, show_all: bool = True) -> list[str]:
    out = io.StringIO()
    render_terminal(trace, Console(file=out, width=width, color_system=None), show_all=show_all)
    return out.getvalue().splitlines()


def _stats(amax: float, *, nan: int = 0) -> TensorStats:
    return TensorStats(dtype="float16", shape=[64], numel=10**8, amax=amax, amin=1e-3,
                       nan=nan, overflow=nan)


@pytest.mark.parametrize(("target", "nan", "amax", "expected"), [
    ("float16", 1234, 6.55e4, ["1,234", "6.55e+04"]),
    ("float16", 9999, 3.1e4, ["9,999"]),
    ("float16", 123_456, 1.0, ["123k"]),
    ("float32", 0, 2.0, ["+127"]),  # log2(float32 max / 2) = 126.99 binades of headroom
    ("bfloat16", 5_000_000, 3.0e38, ["5.0M", "3.00e+38"]),
])
def test_module_table_numbers_are_never_cut(target, nan, amax, expected):
    layer = LayerStats(module="encoder.layers.0.mlp.fc", type="Linear", calls=1,
                       forward=_stats(amax, nan=nan), backward=_stats(1.0))
    trace = Trace(run=RunInfo(target=target), layers=[layer], steps=[StepRecord(0, loss=1.0)])
    lines = _render(trace)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Modules"))
    row = next(ln for ln in lines[start:] if "encoder.layers.0.mlp.fc" in ln)
    assert "…" not in row, row
    for text in expected:
        assert text in row.split(), row
    assert max(len(ln) for ln in lines) <= 80


def test_the_folded_steps_row_keeps_to_its_columns():
    trace = example_trace()
    trace.steps += [StepRecord(i, loss=1.0, scale=4096.0, grad_norm=0.5) for i in range(6, 200)]
    lines = _render(trace, show_all=False)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Timeline"))
    header = lines[start + 1]
    row = next(ln for ln in lines[start:] if "steps hidden" in ln)
    assert "191 steps hidden (6–196)" in row
    # each column's mark is where that column's numbers end (right-aligned) or start (left)
    for name in ("step", "loss", "scale", "grad norm"):
        end = header.index(name) + len(name)
        assert row[end - 1] == "⋮", (name, header, row)
    assert row[header.index("skipped")] == "⋮"
    assert row.index("191 steps hidden") == header.index("note")
