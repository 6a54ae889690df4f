"""Judging a re-run, and the search ladder, on hand-built traces (torch-free)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from nanhunt.analyse.remedies import attach_fixes, ladder, verify_order
from nanhunt.experiment.verify import RerunConfig, judge, verify_by_rerun
from nanhunt.trace import (
    Failure,
    Finding,
    LayerStats,
    Recommendation,
    RunInfo,
    StepRecord,
    TensorStats,
    Trace,
)


def _failure(step: int, module: str = "enc.blocks.1.wo") -> Failure:
    return Failure(step=step, phase="forward", module=module, tensor="output",
                   stats=TensorStats(dtype="float16", shape=[4], numel=4, posinf=1))


def _original() -> Trace:
    t = Trace(run=RunInfo(target="float16", device="cpu", scaler=True, autocast=True))
    t.steps = [StepRecord(index=i, loss=1.0) for i in range(4)]
    t.first_failure = _failure(3)
    t.problem = True
    return t


def _rerun(losses, skipped=(), failure=None, status="stopped", scale=65536.0) -> Trace:
    t = Trace(run=RunInfo(status=status, fixes=["fp32:x"]))
    t.steps = [StepRecord(index=i, loss=v, skipped=i in skipped, scale=scale)
               for i, v in enumerate(losses)]
    t.first_failure = failure
    t.problem = failure is not None
    return t


def test_a_run_that_trains_is_verified_with_its_figures():
    t = judge(_original(), _rerun([1.4, 1.3, 1.2, 1.1, 1.0, 1.0, 0.9, 0.9, 0.8]), 9,
              exit_code=1)
    assert t.verified
    assert t.steps == 9 and t.losses[0] == 1.4 and t.skipped == []
    assert "9 steps" in t.reason and "no skipped step" in t.reason


def test_the_first_calibration_skips_are_allowed_a_streak_later_is_not():
    ok = judge(_original(), _rerun([1.0] * 9, skipped=(0, 1)), 9, exit_code=0)
    assert ok.verified and "calibration" in ok.reason
    streak = judge(_original(), _rerun([1.0] * 9, skipped=(4, 5)), 9, exit_code=0)
    assert not streak.verified and "skipped steps" in streak.reason
    every = judge(_original(), _rerun([1.0] * 9, skipped=range(9)), 9, exit_code=0)
    assert not every.verified and "skipped all 9" in every.reason


def test_a_moved_failure_is_not_verified_and_says_where():
    t = judge(_original(), _rerun([1.0] * 7, failure=_failure(6, "enc.blocks.0.wo")), 9,
              exit_code=1)
    assert not t.verified
    assert t.failure_step == 6 and "new first failure" in t.reason and "blocks.0" in t.reason
    same = judge(_original(), _rerun([1.0] * 4, failure=_failure(3)), 9, exit_code=1)
    assert "original failure remains" in same.reason


@pytest.mark.parametrize(("losses", "why"), [
    ([1.0, 2.0, 30.0, 1.0, 1, 1, 1, 1, 1], "blew up"),
    ([1.0, math.nan, 1.0, 1, 1, 1, 1, 1, 1], "loss nan"),
    ([1.0, 1.0, 1.0], "stopped after 3 of 9"),
])
def test_what_does_not_count_as_training(losses, why):
    t = judge(_original(), _rerun(losses), 9, exit_code=0)
    assert not t.verified and why in t.reason


def test_a_script_that_ends_past_the_failure_counts():
    t = judge(_original(), _rerun([1.0] * 6, status="complete"), 9, exit_code=0)
    assert t.verified


def test_a_finite_problem_verifies_when_the_whole_script_runs_again():
    # nothing went non-finite (an Adam lr too high: a rising loss): a re-run that ends cleanly
    # after as many steps as the original counts; one that ends sooner does not
    original = _original()
    original.first_failure = None
    original.steps = [StepRecord(index=i, loss=4.0 * (i + 1)) for i in range(6)]
    assert judge(original, _rerun([4.0] * 6, status="complete"), 11, exit_code=0).verified
    short = judge(original, _rerun([4.0] * 5, status="complete"), 11, exit_code=0)
    assert not short.verified and "stopped after 5 of 11" in short.reason


def test_no_report_is_not_verified():
    t = judge(_original(), None, 9, exit_code=2, output_tail="nanhunt: --fix x: bad\n")
    assert not t.verified and "nanhunt: --fix x: bad" in t.reason


def _fp32_trace() -> Trace:
    t = _original()
    t.layers = [LayerStats(module=m, type=ty) for m, ty in [
        ("enc.blocks.0.ffn.wo", "Linear"), ("enc.blocks.0", "Block"),
        ("enc.blocks.1.ffn.wo", "Linear"), ("enc.blocks.1", "Block"), ("enc", "Encoder"),
        ("norm", "LayerNorm"), ("criterion", "CrossEntropyLoss"), ("model", "Model")]]
    t.first_failure = _failure(3, "enc.blocks.1.ffn.wo")
    t.recommendations = [
        Recommendation("clamp", 64504.0, "", module="enc.blocks.1.ffn.wo",
                       data={"where": "output", "bound": 64504.0}),
        Recommendation("fp32_module", "x", "", module="enc.blocks.1.ffn.wo",
                       data={"region": ["enc.blocks.1.ffn.wo", "norm"], "cast_to": "float16"}),
        Recommendation("normalize_input", {}, "x = 1", module="enc"),
    ]
    return t


def test_the_ladder_widens_from_the_instance_to_the_model():
    t = _fp32_trace()
    attach_fixes(t)
    order = verify_order(t.recommendations)
    assert [r.type for r in order] == ["fp32_module", "clamp"]  # likeliest cure first
    rungs = [r[0] for r in ladder(order[0], t)]
    assert rungs == ["fp32:enc.blocks.1.ffn.wo..norm", "fp32:enc.blocks.*.ffn.wo..norm",
                     "fp32:enc.blocks.*..norm", "fp32:enc..norm", "fp32:model"]
    assert t.recommendations[2].code_change and t.recommendations[2].fix == []
    assert "run_in_float32" in t.recommendations[1].snippet


def test_a_float32_output_above_the_max_skips_the_cast_back_rungs():
    t = _fp32_trace()
    rec = t.recommendations[1]
    rec.data = {"region": ["enc.blocks.1.ffn.wo"], "cast_to": "float16", "fp32_exceeds": True}
    attach_fixes(t)
    rungs = [r[0] for r in ladder(rec, t)]
    assert "fp32:enc.blocks.1.ffn.wo" not in rungs and "fp32:enc.blocks.*.ffn.wo" not in rungs
    assert rungs[0] == "fp32:enc.blocks.*"


def test_eps_and_floor_rise_by_factors_of_ten():
    t = _original()
    rec = Recommendation("clamp", 6.103515625e-05, "", module="norm",
                         data={"where": "op_input", "op": "sqrt", "min": 6.103515625e-05})
    t.recommendations = [rec]
    attach_fixes(t)
    assert [r[0] for r in ladder(rec, t)] == ["floor:norm:sqrt=6.103515625e-05",
                                              "floor:norm:sqrt=0.00061", "floor:norm:sqrt=0.0061"]


def test_a_multi_process_job_nanhunt_cannot_start_again_is_not_rerun(tmp_path: Path):
    t = _fp32_trace()
    t.run.world_size = 2
    attach_fixes(t)
    why = "its 2 ranks run on several machines (LOCAL_WORLD_SIZE 1)"
    verify_by_rerun(t, RerunConfig(script="x.py", module=None, args=[], cwd=str(tmp_path),
                                   env={}, not_rerun=why), tmp_path)
    assert why in t.verification.note and why in t.experiments.note
    assert "the rules' alone" in t.experiments.note
    assert t.verification.tries == 0
    assert not any(r.verified for r in t.recommendations)


def test_no_problem_no_rerun(tmp_path: Path):
    t = Trace(run=RunInfo())
    t.diagnosis = Finding(rule="x", kind="overflow", severity="warning", message="m")
    verify_by_rerun(t, RerunConfig(script="x.py", module=None, args=[], cwd=str(tmp_path),
                                   env={}), tmp_path)
    assert t.verification.tries == 0 and "no problem" in t.verification.note


def test_a_crashed_rerun_says_it_crashed_not_that_the_scaler_skipped():
    # an HF Trainer re-run that raised a TypeError before its first step (the sandbox's old
    # logging_dir) was reported as "GradScaler skipped all 0 steps"
    crashed = _rerun([], status="crashed")
    crashed.run.error = "TypeError: TrainingArguments.__init__() got an unexpected keyword " \
        "argument 'logging_dir'"
    t = judge(_original(), crashed, 9, exit_code=3)
    assert not t.verified
    assert t.reason.startswith("the re-run crashed after 0 steps: TypeError")
    late = _rerun([1.0] * 9, status="crashed")
    late.run.error = "RuntimeError: boom\nmore"
    t = judge(_original(), late, 9, exit_code=3)
    assert not t.verified and t.reason == "the re-run crashed after 9 steps: RuntimeError: boom"
    assert "no training step" in judge(_original(), _rerun([]), 9, exit_code=0).reason


def _clip_and_lr_trace(optimizers):
    from nanhunt.trace import OptimizerInfo

    t = _original()
    t.optimizers = [OptimizerInfo(type="AdamW", name=n) for n in optimizers]
    t.recommendations = [
        Recommendation("clip_grad_norm", 1.0, "optimizer.step()  # written for `optimizer`"),
        Recommendation("lower_lr", 0.1, ""),
        Recommendation("normalize_input", {}, "scaler.step(optimizer)\noptimizer.zero_grad()"),
    ]
    return t


def test_snippets_use_the_scripts_own_name_for_its_optimizer():
    # minGPT's trainer steps self.optimizer: a snippet naming `optimizer` names nothing there
    t = _clip_and_lr_trace(["self.optimizer"])
    attach_fixes(t)
    clip, lr, other = t.recommendations
    assert clip.fix == ["clip=1"] and "for group in self.optimizer.param_groups" in clip.snippet
    assert lr.fix == ["lr-factor=0.1"] and lr.snippet.startswith(
        "for group in self.optimizer.param_groups:")
    assert other.snippet == "scaler.step(self.optimizer)\nself.optimizer.zero_grad()"
    unnamed = _clip_and_lr_trace([None])  # stepped, but held by no variable of the script's
    attach_fixes(unnamed)
    assert "for group in optimizer.param_groups" in unnamed.recommendations[0].snippet


def test_a_script_without_an_optimizer_gets_no_optimizer_fix():
    # pytorch/examples' word_language_model updates its weights by hand (p.data.add_)
    t = _clip_and_lr_trace([])
    attach_fixes(t)
    clip, lr, _ = t.recommendations
    for rec in (clip, lr):
        assert rec.fix == [] and rec.code_change
        assert re.search(r"(?<![\w.])optimizer(?!\w)", rec.snippet) is None, rec.snippet
    assert "clip_grad_norm_(model.parameters(), max_norm=1)" in clip.snippet
    assert lr.snippet.startswith("lr = lr * 0.1")
