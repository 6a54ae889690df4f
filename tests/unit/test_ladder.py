"""Reading the experiment ladder (nanhunt.experiment.ladder, nanhunt.experiment.verify's conditions)
on hand-built traces: each row of the decision table in docs/rules.md, the control's facts, and what
makes a fix verified. Torch-free."""

from __future__ import annotations

import math

import pytest

from nanhunt.experiment.ladder import classify, control_facts, horizon, next_rungs, outcome
from nanhunt.experiment.verify import _conditions, judge
from nanhunt.trace import (
    Experiment,
    Experiments,
    Failure,
    Finding,
    FixTry,
    OptimizerInfo,
    RunInfo,
    StepRecord,
    TensorStats,
    Trace,
)


def _failure(step: int) -> Failure:
    return Failure(step=step, phase="forward", module="m", tensor="output",
                   stats=TensorStats(dtype="float16", shape=[4], numel=4, posinf=1))


def _original(step: int = 3, kind: str = "overflow") -> Trace:
    t = Trace(run=RunInfo(target="float16", device="cpu", scaler=True, autocast=True,
                          dtypes=["float16", "float32"]))
    t.steps = [StepRecord(index=i, loss=2.0 - 0.1 * i) for i in range(step)]
    t.steps.append(StepRecord(index=step, loss=math.nan, skipped=True))
    t.first_failure = _failure(step)
    t.diagnosis = Finding(rule="r", kind=kind, severity="error", message="m", step=step)
    t.problem = True
    return t


def _rerun(losses, failure=None, status="stopped", skipped=()) -> Trace:
    t = Trace(run=RunInfo(status=status))
    t.steps = [StepRecord(index=i, loss=v, skipped=i in skipped) for i, v in enumerate(losses)]
    t.first_failure = failure
    t.problem = failure is not None
    return t


def _ex(original: Trace, **outcomes: str) -> Experiments:
    ex = Experiments(failure_step=original.first_failure.step, control_reproduced=True)
    for rung, result in outcomes.items():
        name = {"lr_0_1": "lr-0.1", "no_scaler": "no-scaler", "skip_batch": "skip-batch"}.get(
            rung, rung)
        ex.runs.append(Experiment(rung=name, outcome=result,
                                  fixes=["lr-factor=0.1"] if rung == "lr_0_1" else []))
    return ex


def test_horizon_is_twice_the_failure_step_or_twenty_past_it():
    t = _original(3)
    assert horizon(3, t, None) == 24  # max(6, 23) + 1 steps: steps 0..23
    assert horizon(30, t, None) == 61  # max(60, 50) + 1
    assert horizon(30, t, 40) == 40  # --max-steps bounds it


@pytest.mark.parametrize(("outcomes", "verdict"), [
    ({"fp32": "trained", "bf16": "trained"}, "precision-range"),
    ({"fp32": "trained", "bf16": "recurred"}, "precision-resolution"),
    ({"fp32": "trained", "bf16": "recurred", "no_scaler": "trained"}, "loss-scaling"),
    ({"fp32": "recurred", "lr_0_1": "trained"}, "optimisation"),
    ({"fp32": "recurred", "lr_0_1": "recurred", "skip_batch": "trained"}, "data"),
    ({"fp32": "moved", "lr_0_1": "diverged", "skip_batch": "recurred"}, "not-precision"),
    # a float32 run has no fp32 rung: the learning-rate and batch rungs still decide
    ({"lr_0_1": "trained"}, "optimisation"),
    ({"lr_0_1": "recurred", "skip_batch": "trained"}, "data"),
    ({"lr_0_1": "recurred"}, "not-precision"),
])
def test_the_decision_table(outcomes, verdict):
    t = _original()
    ex = _ex(t, control="recurred", **outcomes)
    classify(ex, t)
    assert ex.verdict == verdict, ex.verdict_text


def test_a_precision_rule_that_recurs_in_float32_loses():
    t = _original(kind="overflow")
    ex = _ex(t, control="recurred", fp32="recurred")
    classify(ex, t)
    assert ex.verdict == "not-precision"
    assert "recurs in float32" in ex.contradiction and "overflow" in ex.contradiction


def test_an_lr_rule_that_float32_cures_loses():
    t = _original(kind="lr_too_high")
    ex = _ex(t, control="recurred", fp32="trained", bf16="trained")
    classify(ex, t)
    assert ex.verdict == "precision-range" and "lr too high" in ex.contradiction


def test_a_control_that_trains_is_not_reproduced_and_says_so():
    t = _original()
    ex = Experiments(failure_step=3)
    c = outcome(Experiment(rung="control", target_steps=24), t,
                _rerun([2.0, 1.9, 1.8, 1.7, 1.6, 1.5], status="complete"), exit_code=0)
    ex.runs.append(c)
    control_facts(ex, t)
    classify(ex, t)
    assert c.outcome == "trained" and ex.control_reproduced is False
    assert ex.verdict == "not-reproduced" and "did not recur" in ex.verdict_text
    assert ex.deterministic is True and ex.spread == 0.0  # steps 0-2 equal the original's


def test_a_control_with_other_losses_is_not_deterministic():
    t = _original()
    ex = Experiments(failure_step=3)
    ex.runs.append(outcome(Experiment(rung="control", target_steps=24), t,
                           _rerun([2.0, 1.95, 1.8, math.nan], failure=_failure(3)),
                           exit_code=1))
    control_facts(ex, t)
    assert ex.control_reproduced is True
    assert ex.deterministic is False and ex.spread == pytest.approx(0.05)


def test_outcomes():
    t = _original()
    moved = outcome(Experiment("fp32", target_steps=24), t, _rerun([1.0] * 7, _failure(6)),
                    exit_code=1)
    assert moved.outcome == "moved" and moved.failure_step == 6
    crashed = outcome(Experiment("bf16", target_steps=24), t,
                      _rerun([1.0], status="crashed"), exit_code=1)
    assert crashed.outcome == "crashed" and crashed.detail.startswith("re-run crashed")
    diverged = outcome(Experiment("lr-0.1", target_steps=24), t,
                       _rerun([1.0, 5.0, 50.0] + [1.0] * 21), exit_code=0)
    assert diverged.outcome == "diverged" and "blew up" in diverged.detail
    streak = outcome(Experiment("lr-0.1", target_steps=24), t,
                     _rerun([1.0] * 24, skipped=(5, 6, 7)), exit_code=0)
    assert streak.outcome == "diverged" and "skipped" in streak.detail
    short = outcome(Experiment("fp32", target_steps=24), t, _rerun([1.0] * 10), exit_code=0)
    assert short.outcome == "stopped"
    none = outcome(Experiment("fp32", target_steps=24), t, None, exit_code=3,
                   output_tail="Traceback...\nRuntimeError: boom\n")
    assert none.outcome == "crashed" and none.detail == "re-run crashed: RuntimeError: boom"


def test_a_rerun_that_crashed_before_the_failure_step_is_never_a_training_result():
    t = _original()
    rerun = _rerun([1.0, 1.0], status="crashed")
    rerun.run.error = "RuntimeError: dtype mismatch"
    r = judge(t, rerun, 24, exit_code=1)
    assert not r.verified
    assert r.reason == "the re-run crashed after 2 steps: RuntimeError: dtype mismatch"


def _fix(losses, status="stopped") -> tuple[FixTry, Experiment]:
    t = _original()
    rerun = _rerun(losses, status=status)
    return judge(t, rerun, 24, exit_code=0), outcome(Experiment("fix", target_steps=24), t,
                                                      rerun, exit_code=0)


def test_verified_needs_every_condition_and_says_which_held():
    t = _original()
    ex = _ex(t, control="recurred")
    ex.runs.append(Experiment("fp32", outcome="trained", losses=[2.0 - 0.01 * i
                                                                  for i in range(24)]))
    ex.spread = 0.0
    result, e = _fix([2.0 - 0.01 * i for i in range(24)])
    _conditions(result, e, ex)
    assert result.verified and all(result.conditions[k] for k in
                                   ("control_reproduced", "past_horizon", "finite",
                                    "no_skip_streak", "within_fp32_noise"))
    assert "held: control reproduced, past horizon" in result.reason
    # learning clearly less than the float32 experiment: not verified, and it says why
    result, e = _fix([2.0] * 24)
    _conditions(result, e, ex)
    assert not result.verified and result.conditions["within_fp32_noise"] is False
    assert "above the float32 experiment's" in result.reason
    # no control that failed: never verified
    ex.control_reproduced = False
    result, e = _fix([2.0 - 0.01 * i for i in range(24)])
    _conditions(result, e, ex)
    assert not result.verified and result.conditions["control_reproduced"] is False


def test_a_fix_that_only_delays_the_failure_past_the_old_horizon_is_not_verified():
    # the old horizon was failure + 5 = 8 steps; a fix that fails at step 12 trained 8 steps
    t = _original()
    ex = _ex(t, control="recurred")
    rerun = _rerun([1.0] * 13, failure=_failure(12))
    result = judge(t, rerun, 24, exit_code=1)
    e = outcome(Experiment("fix", target_steps=24), t, rerun, exit_code=1)
    _conditions(result, e, ex)
    assert not result.verified and e.outcome == "moved"


def test_next_rungs_follow_the_float32_outcome():
    t = _original()
    t.optimizers = [OptimizerInfo(type="SGD")]
    t.steps[0].lr = 0.1
    ex = _ex(t, control="recurred", fp32="trained")
    assert [r.name for r in next_rungs(t, ex)] == ["bf16", "no-scaler"]
    ex = _ex(t, control="recurred", fp32="recurred")
    assert [r.name for r in next_rungs(t, ex)] == ["lr-0.1", "lr-0.01", "skip-batch"]
    assert next_rungs(t, ex)[-1].fixes == ("skip-batch=3",)


def test_another_finding_in_a_run_that_trained_is_said_not_its_outcome():
    t = _original(kind="overflow")
    other = _rerun([2.0 - 0.05 * i for i in range(24)])
    other.problem = True
    other.diagnosis = Finding(rule="g", kind="exploding_gradient", severity="error", message="m")
    e = outcome(Experiment("fp32", target_steps=24), t, other, exit_code=1)
    assert e.outcome == "trained" and "exploding gradient" in e.detail
    same = _rerun([2.0] * 24)
    same.problem = True
    same.diagnosis = Finding(rule="r", kind="overflow", severity="error", message="m")
    assert outcome(Experiment("fp32", target_steps=24), t, same, exit_code=1).outcome == \
        "diverged"
