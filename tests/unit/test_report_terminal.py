"""The rich terminal report, rendered on hand-built traces at 80 columns without colour."""

from __future__ import annotations

import io
import math

import pytest
from rich.console import Console

from nanhunt.formats import get_format
from nanhunt.report import render_terminal
from nanhunt.report._common import (
    HiddenSteps,
    fmt_compact,
    fmt_num,
    fmt_pct,
    fmt_scale,
    fold_steps,
    module_rows,
    verdict,
)
from nanhunt.report._example import example_trace
from nanhunt.trace import (
    Failure,
    Finding,
    LayerStats,
    RankSummary,
    Recommendation,
    RunInfo,
    StepRecord,
    TensorStats,
    Trace,
)

FP16 = get_format("float16")


# ----------------------------------------------------------------------------- factory


def stats(amax: float, amin: float = 1e-3, *, nan: int = 0, posinf: int = 0, underflow: int = 0):
    return TensorStats(
        dtype="float16",
        shape=[4, 4],
        numel=1000,
        nan=nan,
        posinf=posinf,
        amax=amax,
        amin=amin,
        overflow=nan + posinf,
        underflow=underflow,
    )


def layer(name: str, fwd_amax: float, bwd_amax: float = 1.0, **kw) -> LayerStats:
    return LayerStats(
        module=name, type="Linear", calls=1, forward=stats(fwd_amax, **kw), backward=stats(bwd_amax)
    )


def render(trace: Trace, width: int = 80, **kw) -> list[str]:
    out = io.StringIO()
    render_terminal(trace, Console(file=out, width=width, color_system=None), **kw)
    return out.getvalue().splitlines()


def text_of(lines: list[str]) -> str:
    return "\n".join(line.rstrip() for line in lines)


def table_modules(lines: list[str], names: list[str]) -> list[str]:
    """Module names in the order their table rows appear."""
    found = []
    for line in lines:
        words = line.replace("▶", " ").split()
        if words and words[0] in names:
            found.append(words[0])
    return found


# ----------------------------------------------------------------------------- verdict


def test_problem_verdict_names_kind_phase_step_and_module():
    lines = render(example_trace())
    assert lines[0].startswith("╭")
    assert "PROBLEM: overflow in forward at step 3, module encoder.blocks.1.ffn.wo" in lines[1]


def test_ok_verdict_counts_warnings():
    trace = Trace(layers=[layer("fc", 10.0)])
    assert "OK: no non-finite values; 0 warnings" in text_of(render(trace))
    trace.warnings = [Finding("r", "overflow", "warning", "near max", score=1.0)]
    assert "OK: no non-finite values; 1 warning" in text_of(render(trace))


def test_ok_verdict_mentions_facts():
    trace = Trace(facts=["step 0: inf gradients, GradScaler skipped the step"])
    assert "OK: no problem found (1 expected non-finite event" in text_of(render(trace))


@pytest.mark.parametrize(
    ("status", "error", "expected"),
    [
        ("crashed", "Traceback...\nRuntimeError: boom", "(script crashed: RuntimeError: boom)"),
        ("crashed", None, "PARTIAL REPORT (script crashed)"),
        ("interrupted", "KeyboardInterrupt", "PARTIAL REPORT (interrupted: KeyboardInterrupt)"),
        ("running", None, "PARTIAL REPORT (run still in progress)"),
    ],
)
def test_partial_runs_say_so_first(status, error, expected):
    trace = Trace(run=RunInfo(status=status, error=error), steps=[StepRecord(0, loss=1.0)])
    text = text_of(render(trace, width=100))
    assert expected in text
    assert "OK so far: no non-finite values" in text
    assert text.index("PARTIAL REPORT") < text.index("OK so far")


def test_partial_run_with_problem_keeps_both_lines():
    trace = example_trace()
    trace.run.status = "crashed"
    trace.run.error = "RuntimeError: loss is nan"
    v = verdict(trace)
    assert v.partial == "PARTIAL REPORT (script crashed: RuntimeError: loss is nan)"
    assert v.headline.startswith("PROBLEM: overflow")
    text = text_of(render(trace))
    assert "PARTIAL REPORT (script crashed: RuntimeError: loss is nan)" in text
    assert "PROBLEM: overflow in forward at step 3" in text


def test_problem_without_module_names_the_tensor():
    ff = Failure(step=2, phase="forward", module="", tensor="loss", stats=stats(0.0, nan=1))
    trace = Trace(first_failure=ff, problem=True)
    assert verdict(trace).headline == "PROBLEM: non-finite value in forward at step 2, tensor loss"


# ----------------------------------------------------------------------------- sections


def test_first_failure_section_shows_location_source_and_values():
    text = text_of(render(example_trace()))
    assert "step 3 / forward / encoder.blocks.1.ffn.wo / output / aten::addmm" in text
    assert "models/t5.py:88" in text
    assert "› return self.wo(self.dropout(self.act(self.wi(x))))" in text
    assert "37 +inf, 5 -inf, 0 nan" in text
    assert "float16 max 65504" in text


def test_diagnosis_lists_its_evidence():
    trace = example_trace()
    lines = render(trace)
    text = text_of(lines)
    assert "overflow (forward-overflow): encoder.blocks.1.ffn.wo's output exceeds" in text
    bullets = [line.strip() for line in lines if line.strip().startswith("•")]
    assert any("sibling encoder.blocks.0.ffn.wo peaks at 3.12e+04" in b for b in bullets)


def test_warnings_are_ranked_by_score():
    trace = Trace(
        warnings=[
            Finding("a", "underflow", "warning", "low one", score=0.1),
            Finding("b", "overflow", "warning", "high one", score=5.0),
            Finding("c", "loss_scale", "warning", "middle one", score=1.0),
        ]
    )
    text = text_of(render(trace))
    assert text.index("high one") < text.index("middle one") < text.index("low one")


def test_module_table_is_sorted_worst_first():
    trace = Trace(
        layers=[
            layer("safe", 2.0),
            layer("close", 40000.0),  # log2(65504/40000) = 0.71 binades
            layer("broken", 10.0, nan=3),
            layer("middle", 4000.0),
        ]
    )
    lines = render(trace)
    assert table_modules(lines, ["safe", "close", "broken", "middle"]) == [
        "broken",
        "close",
        "middle",
        "safe",
    ]
    rows = module_rows(trace, FP16)
    assert rows[1].headroom == pytest.approx(math.log2(65504 / 40000))
    assert rows[0].nonfinite == 3
    assert rows[0].headroom == -math.inf


def test_culprit_row_comes_first_and_is_marked():
    trace = Trace(layers=[layer("a", 60000.0), layer("b", 1.0)])
    trace.first_failure = Failure(3, "forward", "b", "output", stats(1.0, posinf=2))
    lines = render(trace)
    row = next(line for line in lines if "b " in line and "▶" in line)
    assert row.lstrip().startswith("▶ b")
    assert table_modules(lines, ["a", "b"]) == ["b", "a"]
    assert "▶ first failure" in text_of(lines)


def test_module_table_folds_to_max_layers():
    names = [f"model.layers.{i}.mlp.down_proj" for i in range(20)]
    trace = Trace(layers=[layer(name, 2.0**i) for i, name in enumerate(names)])
    lines = render(trace, max_layers=5)
    shown = table_modules(lines, names)
    assert shown == names[::-1][:5]  # the largest amax (least headroom) first
    assert "… 15 more modules (use --all)" in text_of(lines)
    all_lines = render(trace, show_all=True, max_layers=5)
    assert len(table_modules(all_lines, names)) == 20
    assert "more modules" not in text_of(all_lines)


def test_module_table_reads_at_80_columns():
    lines = render(example_trace())
    header = next(i for i, line in enumerate(lines) if line.startswith("module"))
    assert "type" in lines[header]
    assert "amax" in lines[header]
    row = next(line for line in lines if "encoder.blocks.1.ffn.wo" in line and "▶" in line)
    assert row.split()[1:] == ["encoder.blocks.1.ffn.wo", "Linear", "6.55e+04", "2.9", "-inf",
                               "1.6%", "42"]  # fmt: skip


def test_timeline_folds_long_runs_but_keeps_skipped_and_nonfinite_steps():
    steps = [StepRecord(i, loss=1.0, scale=65536.0, grad_norm=0.5) for i in range(100)]
    steps[40].skipped = True
    steps[70].nonfinite = True
    steps[70].loss = math.nan
    trace = Trace(steps=steps)
    lines = render(trace)
    shown = [int(line.split()[0]) for line in lines if line.strip()[:1].isdigit()]
    assert shown == [0, 1, 2, 40, 70, 97, 98, 99]
    text = text_of(lines)
    assert "37 steps hidden" in text
    assert "26 steps hidden" in text
    assert "skipped" in next(line for line in lines if line.strip().startswith("40 "))
    assert fold_steps(trace, show_all=True) == steps


def test_timeline_marks_failure_and_scaler_backoff():
    text = text_of(render(example_trace()))
    step3 = next(line for line in text.splitlines() if line.strip().startswith("3 "))
    assert "nan" in step3
    assert "2^14" in step3
    assert "first failure, backoff → 2^13" in step3


def test_recommendations_show_type_verification_and_snippet():
    text = text_of(render(example_trace()))
    assert "1. fp32_module · encoder.blocks.*.ffn.wo" in text
    assert "✓ verified by re-run: 9 steps" in text
    assert "nanhunt diagnose --fix 'fp32:encoder.blocks.*.ffn.wo..norm' ..." in text
    assert "2. init_scale · value 4096 (2^12)" in text
    assert "✗ not verified: not re-run (another fix was verified first)" in text
    assert 'scaler = torch.amp.GradScaler("cuda", init_scale=4096.0)' in text
    assert "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)" in text
    lines = text.splitlines()
    loop = next(line for line in lines if "for block in model.encoder.blocks:" in line)
    body = next(line for line in lines if "block.ffn.wo = FP32(block.ffn.wo)" in line)
    assert len(body) - len(body.lstrip()) == len(loop) - len(loop.lstrip()) + 4


def test_facts_are_listed_and_folded():
    trace = Trace(facts=[f"fact number {i}" for i in range(12)])
    text = text_of(render(trace))
    assert "• fact number 0" in text
    assert "fact number 11" not in text
    assert "… 4 more facts (use --all)" in text
    assert "• fact number 11" in text_of(render(trace, show_all=True))


def rank_failure(step: int = 5, phase: str = "backward", rank: int | None = None) -> Failure:
    return Failure(step, phase, "fc", "grad_output[0]", stats(1.0, nan=1), rank=rank)


def rank_steps(n: int, fail: int | None = None, loss: float = 2.0) -> list[StepRecord]:
    return [
        StepRecord(
            i,
            loss=math.nan if i == fail else loss + i / 10,
            scale=65536.0,
            skipped=i == fail,
            grad_norm=1.5,
            nonfinite=i == fail,
        )
        for i in range(n)
    ]


def multi_rank_trace() -> Trace:
    """Three ranks: rank 1 failed first, rank 0 was clean, rank 2 never answered."""
    ff = rank_failure(2, "data", rank=1)
    return Trace(
        run=RunInfo(world_size=3, status="crashed", error="ranks 2 did not answer"),
        steps=rank_steps(3, fail=2),
        first_failure=ff,
        problem=True,
        diagnosis=Finding("bad_input", "bad_input", "error", "a NaN in the batch"),
        ranks=[
            RankSummary(0, steps=rank_steps(3, loss=5.0), status="stopped"),
            RankSummary(1, first_failure=ff, steps=rank_steps(3, fail=2), status="stopped"),
            RankSummary(2, answered=False, status="no answer"),
        ],
    )


def test_verdict_names_the_failing_rank():
    lines = render(multi_rank_trace())
    assert "PROBLEM: bad input in data at step 2, module fc on rank 1" in lines[2]
    assert "3 ranks" in text_of(lines)


def test_verdict_says_every_rank_when_all_failed_alike():
    trace = multi_rank_trace()
    trace.run.world_size = 2
    trace.all_ranks_failed = True
    trace.first_failure.rank = 0
    trace.ranks = [
        RankSummary(r, first_failure=rank_failure(2, "data", rank=r), steps=rank_steps(3, fail=2))
        for r in range(2)
    ]
    assert verdict(trace).headline.endswith("module fc on every rank (2 of 2)")
    assert "on every rank (2 of 2)" in text_of(render(trace))


def test_verdict_says_every_rank_that_answered():
    trace = multi_rank_trace()
    trace.ranks[0].first_failure = rank_failure(2, "data", rank=0)
    assert verdict(trace).headline.endswith(" on every rank that answered (2 of 3)")


def test_one_process_verdict_names_no_rank():
    trace = multi_rank_trace()
    trace.run.world_size = 1
    trace.ranks = []
    assert "rank" not in verdict(trace).headline


def test_ranks_table_shows_status_counts_and_first_failure():
    trace = multi_rank_trace()
    trace.ranks[0].status = "crashed"
    trace.ranks[0].error = "Traceback ...\nRuntimeError: Connection closed by peer"
    lines = text_of(render(trace)).split("Ranks (3)", 1)[1].splitlines()
    assert lines[1].split() == ["rank", "status", "steps", "skipped", "first", "failure"]
    assert lines[3].split() == ["0", "crashed", "3", "0", "—"]
    assert lines[4].split() == ["▶", "1", "answered", "3", "1", "step", "2", "/", "data", "/",
                                "fc", "/", "grad_output[0]"]  # fmt: skip
    assert lines[5].split() == ["2", "no", "answer", "—", "—", "—"]
    assert lines[6] == "• rank 0 crashed: RuntimeError: Connection closed by peer"
    assert lines[7].startswith("▶ origin (first to fail)")


def test_each_rank_gets_its_own_step_timeline():
    lines = render(multi_rank_trace())
    text = text_of(lines)
    for rank, fail in ((0, None), (1, 2)):
        head = next(i for i, line in enumerate(lines) if line.startswith(f"rank {rank} · 3 steps"))
        rows = [line.split() for line in lines[head + 3 : head + 6]]
        assert [r[0] for r in rows] == ["0", "1", "2"]
        if fail is None:
            assert "no non-finite values" in lines[head]
            assert rows[0][1] == "5"  # rank 0's own loss, not the origin's
        else:
            assert "first failure at step 2" in lines[head]
            assert rows[2][1:4] == ["nan", "2^16", "skipped"]
            assert "first failure" in lines[head + 5]
    assert "rank 2 ·" not in text  # no answer, no steps: the table says so


def test_rank_timelines_are_folded_and_capped():
    trace = multi_rank_trace()
    trace.run.world_size = 11
    trace.ranks = [RankSummary(r, steps=rank_steps(30)) for r in range(10)]
    trace.ranks.append(RankSummary(10, first_failure=rank_failure(9), steps=rank_steps(30, 9)))
    trace.first_failure.rank = 10
    text = text_of(render(trace))
    assert text.count(" · 30 steps") == 8
    assert "rank 10 · 30 steps · first failure at step 9" in text  # the origin comes first
    assert "rank 7 · 30 steps" not in text
    assert "… 3 more rank timelines (use --all)" in text
    assert "26 steps hidden" in text  # 2 first and 2 last steps
    full = text_of(render(trace, show_all=True))
    assert full.count(" · 30 steps") == 11
    assert "steps hidden" not in full


def test_ranks_section_reads_at_80_columns():
    trace = multi_rank_trace()
    long = "model." + ".".join(f"very_long_submodule_name_{i}" for i in range(5))
    trace.ranks[1].first_failure.module = long
    trace.ranks[0].status = "interrupted"
    trace.ranks[0].error = "KeyboardInterrupt: " + "x" * 150
    lines = render(trace)
    assert all(len(line) <= 80 for line in lines)
    assert "very_long_submodule_name_4" in "".join(line.strip() for line in lines)


# ----------------------------------------------------------------------------- robustness


def hostile_trace() -> Trace:
    long = "model." + ".".join(f"very_long_submodule_name_{i}" for i in range(6))
    markup = "[red]m[/red]"
    trace = example_trace()
    trace.layers.append(layer(long, math.inf, math.nan))
    trace.layers.append(layer(markup, 1.0))
    trace.first_failure.module = long
    trace.first_failure.source_line = "x = " + "y * " * 40 + "z"
    trace.diagnosis.message = "a message " * 30
    trace.recommendations[0].snippet = "call(" + ", ".join(f"arg{i}" for i in range(40)) + ")"
    trace.facts.append("x" * 200)
    trace.facts.append("[bold]not markup[/bold] :fire:")
    return trace


@pytest.mark.parametrize("show_all", [False, True])
def test_no_line_is_longer_than_80_columns(show_all):
    for trace in (example_trace(), hostile_trace(), Trace()):
        lines = render(trace, show_all=show_all)
        # code is the exception: never wrapped, so that a copied snippet is the snippet
        code = {"   " + ln for r in trace.recommendations for ln in r.snippet.splitlines()}
        assert max(len(line) for line in lines if line.rstrip() not in code) <= 80
    long_call = hostile_trace().recommendations[0].snippet
    assert "   " + long_call in render(hostile_trace())  # whole, on one line


def test_user_strings_are_not_rich_markup():
    text = text_of(render(hostile_trace(), show_all=True))
    assert "[red]m[/red]" in text
    assert "[bold]not markup[/bold] :fire:" in text


def test_no_colour_codes_without_a_terminal_and_colour_with_one():
    assert "\x1b[" not in "\n".join(render(example_trace()))
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system="truecolor")
    render_terminal(example_trace(), console)
    assert "\x1b[" in out.getvalue()


def test_non_finite_and_missing_stats_render():
    weird = TensorStats(
        dtype="float32", shape=[], numel=0, amax=math.inf, amin=math.inf, headroom=math.nan
    )
    trace = Trace(
        layers=[
            LayerStats(module="nostats", type="Identity"),
            LayerStats(module="weird", type="Linear", forward=weird, backward=stats(0.0)),
        ],
        steps=[StepRecord(0), StepRecord(1, loss=math.inf, scale=3.0, grad_norm=math.nan)],
        recommendations=[Recommendation(type="lower_lr", value=None, snippet="")],
        run=RunInfo(target="no-such-format"),
    )
    text = text_of(render(trace))
    assert "nostats" in text
    assert "weird" in text
    assert "lower_lr" in text


def test_empty_trace():
    lines = render(Trace())  # nothing ran: no OK verdict
    assert "the script exited before any training step" in lines[1]
    assert "OK" not in text_of(lines)
    assert len(lines) == 4  # the panel only


@pytest.mark.parametrize(("status", "code", "expected"), [
    ("complete", 0, ["the script exited before any training step"]),
    ("complete", 2, ["the script exited before any training step", "the script exited with 2"]),
    ("crashed", 1, ["PARTIAL REPORT (script crashed: ValueError: x)",
                    "the script stopped before any training step"]),
])
def test_a_run_with_no_step_says_so(status, code, expected):
    trace = Trace(run=RunInfo(status=status, exit_code=code,
                              error="ValueError: x" if status == "crashed" else None))
    text = text_of(render(trace))
    for line in expected:
        assert line in text
    assert "OK" not in text
    assert "exited with 1" not in text  # a crash is said by the partial line


def test_the_scripts_exit_status_is_said_under_an_ok_verdict():
    trace = Trace(run=RunInfo(exit_code=3), steps=[StepRecord(0, loss=1.0)])
    lines = [ln.strip("│ ") for ln in render(trace)]
    assert lines[1] == "OK: no non-finite values; 0 warnings"
    assert lines[2] == "the script exited with 3"
    trace.run.exit_code = 0
    assert "exited with" not in text_of(render(trace))


# ----------------------------------------------------------------------------- formatting


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "—"),
        (0.0, "0"),
        (210.0, "210"),
        (0.03125, "0.03125"),
        (65504.0, "6.55e+04"),
        (4.1e-8, "4.10e-08"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (math.nan, "nan"),
    ],
)
def test_fmt_num(value, text):
    assert fmt_num(value) == text


def test_fmt_compact_pct_scale():
    assert [fmt_compact(n) for n in (0, 42, 9999, 131072, 2_100_000)] == [
        "0",
        "42",
        "9,999",
        "131k",
        "2.1M",
    ]
    assert [fmt_pct(f) for f in (0.0, 0.0004, 0.016, 0.31)] == ["0%", "<0.1%", "1.6%", "31%"]
    assert fmt_scale(65536.0) == "65536 (2^16)"
    assert fmt_scale(3.0) == "3"
    assert fmt_scale(2.0**-3) == "2^-3"


def test_notes_and_bad_samples():
    trace = example_trace()
    trace.first_failure.bad_samples = {"input[0]": [3, 17]}
    trace.notes = ["the op-level replay failed: RuntimeError: no snapshot"]
    text = text_of(render(trace))
    assert "samples  input[0]: 3, 17" in text
    assert "Notes (limits of this report)" in text
    assert "• the op-level replay failed: RuntimeError: no snapshot" in text


def test_timeline_caps_notable_steps():
    steps = [StepRecord(i, loss=1.0, skipped=i % 10 == 5) for i in range(1000)]
    steps[900].nonfinite = True
    trace = Trace(steps=steps)
    items = fold_steps(trace, notable=3)
    shown = [s.index for s in items if isinstance(s, StepRecord)]
    assert shown == [0, 1, 2, 5, 15, 900, 997, 998, 999]  # the non-finite step comes first
    hidden = [h for h in items if isinstance(h, HiddenSteps)]
    assert sum(h.count for h in hidden) == 1000 - len(shown)
    assert sum(h.skipped for h in hidden) == 100 - 2
    assert [h.describe() for h in hidden] == [
        "2 steps hidden (3–4)",
        "9 steps hidden (6–14)",
        "884 steps hidden (16–899, 88 skipped)",
        "96 steps hidden (901–996, 10 skipped)",
    ]
    lines = render(trace)
    assert len(lines) < 80  # the default keeps 24 notable steps
    assert any(line.strip().startswith("⋮") and "skipped)" in line for line in lines)
