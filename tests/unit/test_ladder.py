"""Reading the experiment ladder (nanhunt.experiment.ladder, nanhunt.experiment.verify's conditions)
on hand-built traces: each row of the decision table in docs/rules.md, the control's facts, and what
makes a fix verified. Torch-free."""

from __future__ import annotations

import dataclasses
import math

import pytest

from nanhunt.experiment.ladder import (
    classify,
    control_facts,
    horizon,
    measured_clip,
    measured_growth_interval,
    measured_init_scale,
    next_rungs,
    outcome,
    silent_verdict,
    source_ranges,
    source_rungs,
    warmup_verdict,
)
from nanhunt.experiment.verify import (
    _adopt_lr_rung,
    _conditions,
    _label,
    _said,
    judge,
    learning,
)
from nanhunt.trace import (
    Experiment,
    Experiments,
    Failure,
    Finding,
    FixTry,
    OptimizerInfo,
    Recommendation,
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
        fixes = {"lr_0_1": ["lr-factor=0.1"],
                 "skip_batch": [f"skip-batch={original.first_failure.step}"]}.get(rung, [])
        ex.runs.append(Experiment(rung=name, outcome=result, fixes=fixes))
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


def test_a_loss_that_changes_level_at_the_failure_step_did_not_blow_up():
    # inputs in new units from step 3, where float16 overflowed: float32 trains there at a new
    # level (92 -> 5870), and only growth past that level is a divergence
    t = _original(3)
    level = [92.0, 91.0, 90.0, 5870.0, 5000.0, 3000.0] + [1000.0] * 18
    fp32 = outcome(Experiment("fp32", target_steps=24), t, _rerun(level), exit_code=0)
    assert fp32.outcome == "trained", fp32.detail
    grows = outcome(Experiment("fp32", target_steps=24), t,
                    _rerun([*level[:5], 6e4, *level[6:]]), exit_code=0)
    assert grows.outcome == "diverged" and "its value at step 3 5.87e+03" in grows.detail
    # with no non-finite failure in the original, the base stays the first loss
    t.first_failure = None
    assert outcome(Experiment("fp32", target_steps=24), t, _rerun(level),
                   exit_code=0).outcome == "diverged"


def test_a_control_that_shows_the_originals_no_nan_problem_reproduced_it():
    # a skip streak (no non-finite value anywhere): the control skips the same way
    t = _original(3, kind="loss_scale")
    t.first_failure = None
    again = _rerun([1.0] * 24, skipped=tuple(range(15)))
    again.problem = True
    again.diagnosis = Finding(rule="skip-streak", kind="loss_scale", severity="error",
                              message="15 skipped")
    c = outcome(Experiment("control", target_steps=24), t, again, exit_code=1)
    assert c.outcome == "recurred" and "same problem: loss scale" in c.detail
    # any other rung showing the same streak has not removed it
    assert outcome(Experiment("fp32", target_steps=24), t, again,
                   exit_code=1).outcome == "diverged"


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
    # the failing batch's non-finite samples named: those alone replaced, a rung of its own;
    # none where every row was bad or the batch's size is unknown (an older report)
    t.first_failure.bad_samples, t.first_failure.batch_rows = {"input[0]": [6, 2]}, 8
    assert next_rungs(t, ex)[-1].fixes == ("skip-samples=3:2,6",)
    t.first_failure.bad_samples = {"input[0]": list(range(8))}
    assert next_rungs(t, ex)[-1].name == "skip-batch"
    t.first_failure.bad_samples, t.first_failure.batch_rows = {"input[0]": [1]}, None
    assert next_rungs(t, ex)[-1].name == "skip-batch"


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


# --- the optimizer and loss-scaling rungs, and contradictions for every kind ------------------


def _rung(name: str, result: str, fix: str = "", step: int | None = None) -> Experiment:
    return Experiment(rung=name, outcome=result, fixes=[fix] if fix else [], failure_step=step)


def _ladder(original: Trace, *runs: Experiment) -> Experiments:
    ex = Experiments(failure_step=original.first_failure.step if original.first_failure
                     else 3, control_reproduced=True)
    ex.runs = [_rung("control", "recurred"), *runs]
    return ex


def test_the_measured_clip_is_the_low_end_of_the_norms_before_the_failure_rounded_up():
    t = _original(6)
    for s, norm in zip(t.steps, (30.2, 2.4, 8.5, 48.0, 589.0, None)):
        s.grad_norm = norm
    # norms growing before the failure (an exploding RNN): the smallest of up to ten, 2.4,
    # rounded up to 1, 2 or 5 times a power of ten
    assert measured_clip(t, 6) == 5.0
    assert measured_clip(t, 1) == 50.0  # 30.2 alone
    t.steps = [StepRecord(index=i, loss=1.0, grad_norm=float(i + 1)) for i in range(40)]
    assert measured_clip(t, 40) == 5.0  # the 4th smallest of 40 (nearest rank), 4
    assert measured_clip(_original(3), 3) is None  # no norm recorded: no clip rung


def test_the_measured_init_scale_comes_from_the_gradients_exponents():
    t = _original(3)
    for s in t.steps:
        s.scale = 65536.0
    # gradients up to binade 2 (|g| < 8): 2^(15 - 2 - 2) = 2^11 keeps two binades of headroom
    t.grad_hist = {"float16": {2: 10, 0: 100, -6: 50}}
    assert measured_init_scale(t) == 2.0 ** 11
    t.grad_hist = {"float16": {0: 10}}  # |g| < 2: 2^(15 - 0 - 2)
    assert measured_init_scale(t) == 2.0 ** 13
    for s in t.steps:
        s.scale = 2.0 ** 13
    assert measured_init_scale(t) is None  # the run's scale is that value already
    t.grad_hist = {}
    assert measured_init_scale(t) is None


def test_the_measured_init_scale_stays_below_every_scale_a_finite_step_skipped_at():
    # calibration from 2^16 down to 2^9, where two batches fitted and a third did not
    t = _original(3)
    scales = [2.0 ** 16, 2.0 ** 12, 2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 9]
    fitted = [False, False, False, True, True, False]
    t.steps = [StepRecord(index=i, loss=3e3, scale=sc, skipped=not ok)
               for i, (sc, ok) in enumerate(zip(scales, fitted))]
    t.grad_hist = {"float16": {-20: 10}}  # tiny unscaled gradients: alone they would allow 2^16
    assert measured_init_scale(t) == 2.0 ** 8  # 2^9 applied twice, but another batch overflowed
    # a step whose loss was already NaN overflowed at any scale: it does not lower the cap
    t.steps[5].loss = math.nan
    assert measured_init_scale(t) == 2.0 ** 9


def test_the_rungs_carry_the_measured_values():
    t = _original(4)
    t.optimizers = [OptimizerInfo(type="SGD")]
    for s, norm in zip(t.steps, (1.9, 1.5, 1.4, 1.3)):
        s.grad_norm, s.scale = norm, 65536.0
    t.grad_hist = {"float16": {3: 5}}
    precision = _ladder(t, _rung("fp32", "trained"))
    assert [(r.name, r.fixes) for r in next_rungs(t, precision)] == [
        ("bf16", ("bf16",)), ("no-scaler", ("no-scaler",)), ("init-scale", ("init-scale=1024",))]
    other = _ladder(t, _rung("fp32", "recurred", step=4))
    other.failure_step = 4
    assert [(r.name, r.fixes) for r in next_rungs(t, other)] == [
        ("lr-0.1", ("lr-factor=0.1",)), ("lr-0.01", ("lr-factor=0.01",)), ("clip", ("clip=2",)),
        ("skip-batch", ("skip-batch=4",))]


@pytest.mark.parametrize(("runs", "verdict", "says"), [
    # clipping at the measured norm trains where the learning rate does not
    ((_rung("fp32", "recurred", step=3), _rung("lr-0.1", "diverged", "lr-factor=0.1"),
      _rung("clip", "trained", "clip=2")), "optimisation", "clipping the gradient norm at 2"),
    # GradScaler from the measured scale trains: loss scaling, not float16's range
    ((_rung("fp32", "trained"), _rung("bf16", "trained", "bf16"),
      _rung("init-scale", "trained", "init-scale=2048")), "loss-scaling",
     "GradScaler from init_scale 2048"),
    # a float32 run (no fp32 rung): the learning-rate rungs decide
    ((_rung("lr-0.1", "trained", "lr-factor=0.1"),), "optimisation", "x0.1 removes it"),
    ((_rung("lr-0.1", "diverged", "lr-factor=0.1"), _rung("lr-0.01", "diverged",
                                                          "lr-factor=0.01")),
     "not-precision", "x0.1 or x0.01 does not (diverged, diverged)"),
])
def test_the_optimizer_and_scaling_rungs_in_the_decision_table(runs, verdict, says):
    t = _original()
    ex = _ladder(t, *runs)
    classify(ex, t)
    assert ex.verdict == verdict and says in ex.verdict_text, ex.verdict_text


@pytest.mark.parametrize(("kind", "runs", "lost"), [
    # every learning-rate rung fails the same way: not the learning rate
    ("lr_too_high", (_rung("lr-0.1", "diverged", "lr-factor=0.1"),
                     _rung("lr-0.01", "diverged", "lr-factor=0.01")), "not the learning rate"),
    ("lr_too_high", (_rung("fp32", "recurred", step=3),
                     _rung("lr-0.1", "recurred", "lr-factor=0.1", 3),
                     _rung("lr-0.01", "recurred", "lr-factor=0.01", 3)), "not the learning rate"),
    # a lower learning rate moved the failure: the learning rate matters, no contradiction
    ("lr_too_high", (_rung("lr-0.1", "diverged", "lr-factor=0.1"),
                     _rung("lr-0.01", "moved", "lr-factor=0.01", 9)), ""),
    ("lr_too_high", (_rung("lr-0.1", "trained", "lr-factor=0.1"),), ""),
    # clipping at the measured norm and the learning rates fail alike: not the gradient's growth
    ("exploding_gradient", (_rung("lr-0.1", "diverged", "lr-factor=0.1"),
                            _rung("lr-0.01", "diverged", "lr-factor=0.01"),
                            _rung("clip", "diverged", "clip=5")), "not the gradient's growth"),
    ("exploding_gradient", (_rung("lr-0.1", "diverged", "lr-factor=0.1"),
                            _rung("clip", "trained", "clip=5")), ""),
    ("exploding_gradient", (_rung("fp32", "trained"), _rung("bf16", "trained", "bf16")),
     "float32 everywhere removes"),
    ("underflow", (_rung("fp32", "moved", step=7),), "recurs in float32"),
    ("loss_scale", (_rung("fp32", "diverged"),), "recurs in float32"),
    ("loss_scale", (_rung("fp32", "trained"), _rung("no-scaler", "trained", "no-scaler")), ""),
    ("overflow", (_rung("fp32", "trained"), _rung("bf16", "trained", "bf16")), ""),
    # a kind the ladder does not test is not contradicted by it
    ("nan_op", (_rung("fp32", "recurred", step=3),), ""),
])
def test_a_rule_whose_cause_the_experiments_contradict_loses(kind, runs, lost):
    t = _original(kind=kind)
    ex = _ladder(t, *runs)
    classify(ex, t)
    if lost:
        assert lost in ex.contradiction and kind.replace("_", " ") in ex.contradiction
        assert "the experiments win" in ex.contradiction
        # the verdict is the experiments': never the cause that lost
        if "learning rate" in lost or "growth" in lost:
            assert ex.verdict != "optimisation"
    else:
        assert ex.contradiction == "", ex.contradiction


def test_the_headline_does_not_lead_with_a_cause_that_lost():
    from nanhunt.report._common import verdict

    t = _original(kind="lr_too_high")
    t.diagnosis.phase = "optimizer"
    ex = _ladder(t, _rung("lr-0.1", "diverged", "lr-factor=0.1"),
                 _rung("lr-0.01", "diverged", "lr-factor=0.01"))
    ex.source = "experiments"
    classify(ex, t)
    t.experiments = ex
    line = verdict(t).headline
    assert line.startswith("PROBLEM: failure in optimizer at step 3")
    assert "(not lr too high: the experiments contradict it)" in line
    assert "x0.1 or x0.01 does not (diverged, diverged)" in line


def test_the_region_is_cited_first_in_the_verdict():
    t = _original(kind="overflow")
    ex = _ladder(t, _rung("fp32", "trained"), _rung("bf16", "recurred", "bf16"))
    ex.region = "fp32:decoder.2.."
    classify(ex, t)
    assert ex.verdict_text.startswith(
        "keeping `decoder.2` in float32 (its output too) removes the failure; bfloat16 does not "
        "(recurred); float32 everywhere does: a precision failure of resolution")
    ex.region, ex.region_text = "", "no module region alone removes it"
    classify(ex, t)
    assert ex.verdict_text.startswith("float32 everywhere removes the failure; bfloat16 does not "
                                      "(recurred); no module region alone removes it")


def test_a_run_that_skipped_steps_caps_the_measured_scale_at_one_that_applied_a_step():
    # the skipped steps' overflowing gradients were inf: not in the histogram, which alone
    # would call for 2^13; the run applied steps at 2^8 and skipped at 2^9 and above
    t = _original(3)
    t.grad_hist = {"float16": {0: 10}}
    t.steps = [StepRecord(index=i, loss=1.0, scale=2.0 ** (16 - i), skipped=True)
               for i in range(8)]
    t.steps += [StepRecord(index=8, loss=1.0, scale=2.0 ** 8),
                StepRecord(index=9, loss=1.0, scale=2.0 ** 9, skipped=True)]
    assert measured_init_scale(t) == 2.0 ** 8
    for s in t.steps:
        s.skipped = True  # none applied: below the smallest scale tried
    assert measured_init_scale(t) == 2.0 ** 7


def test_a_fix_is_not_held_to_another_finding_of_the_rules_in_its_rerun():
    # as the experiments' outcomes: only the original's own problem coming back fails a fix
    t = _original(kind="overflow")
    other = _rerun([2.0 - 0.01 * i for i in range(24)])
    other.problem = True
    other.diagnosis = Finding(rule="w", kind="lr_too_high", severity="error", message="warm-up")
    r = judge(t, other, 24, exit_code=1)
    assert r.verified and "(its own diagnosis, not the original problem: lr too high)" in r.reason
    other.diagnosis = Finding(rule="r", kind="overflow", severity="error", message="again")
    r = judge(t, other, 24, exit_code=1)
    assert not r.verified and r.reason == "the re-run still has a problem: again"


def test_the_lr_advice_takes_the_largest_factor_an_lr_rung_trained_with():
    t = _original(17, kind="lr_too_high")
    t.optimizers = [OptimizerInfo(type="SGD")]
    rec = Recommendation(type="lower_lr", snippet="", value=1e-4, fix=["lr-factor=0.0001"],
                         evidence=["x0.0001 brings the update to about 0.001 of the weights",
                                   "lr 1.5 -> 0.00015", "param group SGD[0]: ..."])
    t.recommendations = [rec]
    ex = _ladder(t, _rung("fp32", "moved", step=4), _rung("lr-0.1", "diverged", "lr-factor=0.1"),
                 _rung("lr-0.01", "trained", "lr-factor=0.01"))
    _adopt_lr_rung(t, ex)
    assert (rec.value, rec.fix) == (0.01, ["lr-factor=0.01"])  # the rung's re-run verifies it
    assert rec.evidence[0] == "param group SGD[0]: ..." and "largest factor" in rec.evidence[-1]
    # an estimate already gentler than anything that trained stays
    rec2 = Recommendation(type="lower_lr", snippet="", value=0.5, fix=["lr-factor=0.5"])
    t.recommendations = [rec2]
    _adopt_lr_rung(t, ex)
    assert (rec2.value, rec2.fix) == (0.5, ["lr-factor=0.5"])


def test_a_half_precision_optimizer_gets_the_master_weights_rung_and_it_is_cited_first():
    t = _original(kind="underflow")
    t.optimizers = [OptimizerInfo(type="SGD", param_dtypes=["float16"])]
    ex = _ex(t, control="recurred", fp32="trained")
    rungs = {r.name: r.fixes for r in next_rungs(t, ex)}
    assert rungs["fp32-master"] == ("fp32-master",)
    t.optimizers = [OptimizerInfo(type="SGD", param_dtypes=["float32"])]
    assert "fp32-master" not in {r.name for r in next_rungs(t, ex)}
    # its outcome is read into the verdict: trained, it is the narrowest cure and said first
    ex = _ladder(t, _rung("fp32", "trained"), _rung("bf16", "recurred", "bf16"),
                 _rung("fp32-master", "trained", "fp32-master"))
    classify(ex, t)
    assert ex.verdict == "precision-resolution"
    assert ex.verdict_text.startswith("float32 master weights and optimizer state remove the "
                                      "failure")
    assert ex.verdict_text.endswith("in the optimizer's 16-bit weights and state")
    ex = _ladder(t, _rung("fp32", "trained"), _rung("bf16", "trained", "bf16"),
                 _rung("fp32-master", "recurred", "fp32-master", step=3))
    classify(ex, t)
    assert ex.verdict == "precision-range"
    assert "float32 master weights alone do not (recurred at step 3)" in ex.verdict_text


def test_a_fix_whose_run_does_not_learn_is_not_verified():
    """The control learned before its failure at step 8 (2.0 falling to 1.3; the mean of its
    first two losses less its last two: 0.6): a fix whose run stays flat, or rises without
    blowing up, removed the failure but not the problem."""
    t = _original(step=8)
    ex = _ex(t, control="recurred")
    ex.runs[0].losses = [2.0 - 0.1 * i for i in range(8)] + [math.nan]
    ex.spread = 0.0
    falling, flat = [2.0 - 0.02 * i for i in range(24)], [2.0] * 24
    result, e = _fix(falling)
    _conditions(result, e, ex)
    assert result.verified and result.conditions["learned"] is True
    assert "learned" in result.reason.split("held: ")[1]
    result, e = _fix(flat)
    _conditions(result, e, ex)
    assert not result.verified and result.conditions["learned"] is False
    assert "did not learn: its loss went 2 -> 2 while the control's fell by 0.6" in result.reason
    # a run that was not learning before the failure (random targets): flat is fine, a loss
    # that climbs (to 3.4, under the blow-up factor) is not
    ex.runs[0].losses = [2.0 + 0.01 * (-1) ** i for i in range(8)] + [math.nan]
    result, e = _fix(flat)
    _conditions(result, e, ex)
    assert result.verified and result.conditions["learned"] is True
    result, e = _fix([2.0 + 0.06 * i for i in range(24)])
    _conditions(result, e, ex)
    assert not result.verified and "its loss rose: 2 -> 3.38" in result.reason
    # a noisy control that fell by chance (first two 2.15, last two 2.05, while its steps jump
    # by 0.3) was not learning: its drop is inside its own scatter, and a flat fix is fine
    ex.runs[0].losses = [2.0, 2.3, 2.0, 2.3, 2.0, 2.3, 1.8, 2.3] + [math.nan]
    result, e = _fix(flat)
    _conditions(result, e, ex)
    assert result.verified and result.conditions["learned"] is True
    # too few losses before the failure to tell: not applicable, and said so by None
    ex.failure_step = 2
    assert learning(e, ex) is None


def test_the_source_rung_widens_from_the_statement_to_the_block_around_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\n"                       # 1
                      "for step in range(3):\n"              # 2
                      "    x = torch.ones(2)\n"              # 3
                      "    with torch.autocast('cpu'):\n"    # 4
                      "        p = torch.softmax(\n"         # 5
                      "            x, dim=-1)\n"             # 6
                      "        loss = -torch.log(p).sum()\n")  # 7
    assert source_ranges(str(script), 6) == [(5, 6), (4, 7)]
    assert source_ranges(str(script), 7) == [(7, 7), (4, 7)]
    assert source_ranges(str(script), 3) == [(3, 3), (2, 7)]
    assert source_ranges(str(tmp_path / "gone.py"), 3) == [(3, 3)]
    t = _original(kind="nan_op")
    ex = _ladder(t, _rung("fp32", "trained"), _rung("bf16", "trained", "bf16"),
                 _rung("lines", "recurred", f"fp32-lines:{script}:7", step=3),
                 _rung("lines", "trained", f"fp32-lines:{script}:4-7"))
    ex.source_line, ex.lines = f"{script}:7", f"fp32-lines:{script}:4-7"
    assert [r.fixes for r in source_rungs(ex)] == [(f"fp32-lines:{script}:7",),
                                                   (f"fp32-lines:{script}:4-7",)]
    classify(ex, t)
    assert ex.verdict_text.startswith("keeping the ops written on lines 4-7 of train.py in "
                                      "float32 removes the failure; line 7 of train.py alone "
                                      "does not; float32 everywhere removes the failure")


def test_a_fix_that_trained_after_another_was_verified_is_not_said_to_have_failed():
    from nanhunt.trace import Verification

    won = Recommendation(type="lr_warmup", value=2000, snippet="", fix=["warmup=2000"])
    also = Recommendation(type="lower_lr", value=0.1, snippet="", fix=["lr-factor=0.1"])
    lost = Recommendation(type="z_loss", value=1e-4, snippet="", fix=["zloss:9=0.0001"])
    won.tries = [FixTry(fixes=won.fix, verified=True, reason="25 steps")]
    also.tries = [FixTry(fixes=also.fix, verified=True, reason="25 steps, held: learned")]
    lost.tries = [FixTry(fixes=lost.fix, verified=False, reason="its loss rose")]
    t = _original()
    t.recommendations = [won, also, lost]
    _label(t, [won], Verification())
    assert won.verified and won.verification.startswith("verified by re-run")
    assert not also.verified
    assert also.verification.startswith("not verified: another fix was verified first; this "
                                        "one's re-run trained too")
    assert lost.verification == "not verified: 1 re-run did not train (its loss rose)"


def test_an_experiment_line_says_its_outcome_once():
    recurred = Experiment("control", outcome="recurred",
                          detail="the failure recurred: step 3 / forward / attn")
    assert _said(recurred) == "the failure recurred: step 3 / forward / attn"
    trained = Experiment("fp32", outcome="trained", detail="5 steps, loss 3.6 -> 3.5")
    assert _said(trained) == "trained: 5 steps, loss 3.6 -> 3.5"


# ----------------------------------------------------------------------------- no failure found


def _healthy(losses, skipped=()) -> Trace:
    t = Trace(run=RunInfo(target="float16", device="cpu", scaler=True, autocast=True,
                          dtypes=["float16", "float32"], status="complete"))
    t.steps = [StepRecord(index=i, loss=v, skipped=i in skipped) for i, v in enumerate(losses)]
    return t


def _judged(original: Trace, rung: str, rerun: Trace) -> Experiment:
    return outcome(Experiment(rung=rung, fixes=[] if rung == "control" else ["fp32-all"],
                              target_steps=len(rerun.steps)), original, rerun, exit_code=0)


def test_gradscaler_skips_the_original_also_made_are_compared_at_as_many_updates():
    """A scaler that grows every 2 steps skips every third: the float16 run's loss after k
    applied updates equals float32's after k; compared step for step it looks 'behind'."""
    n, skipped = 30, {i for i in range(30) if i % 3 == 2}
    fp32 = [3.0 - 0.05 * i for i in range(n)]  # float32: one update a step
    ctl, applied = [], 0
    for i in range(n):
        ctl.append(fp32[applied])  # the same loss after as many updates
        applied += i not in skipped
    original = _healthy(ctl, skipped)
    ex = Experiments()
    control = _judged(original, "control", _rerun(ctl, status="complete", skipped=skipped))
    # two skips in a row would read as a skip streak; these are every third step
    ex.runs = [control, _judged(original, "fp32", _rerun(fp32, status="complete"))]
    assert silent_verdict(ex, original) is None, ex.verdict_text
    assert "as many applied updates" in ex.verdict_text and "skipped 10" in ex.verdict_text
    # the same run learning less per update (a real precision loss) is still found
    worse = [v + 0.01 * i for i, v in enumerate(ctl)]
    original = _healthy(worse, skipped)
    ex = Experiments()
    ex.runs = [_judged(original, "control", _rerun(worse, status="complete", skipped=skipped)),
               _judged(original, "fp32", _rerun(fp32, status="complete"))]
    found = silent_verdict(ex, original)
    assert found is not None and found.kind == "silent_precision", ex.verdict_text


def test_a_streak_of_skips_the_original_run_also_had_is_its_scaler_not_a_divergence():
    n, skipped = 30, {10, 11, 20, 21}
    losses = [3.0 - 0.05 * i for i in range(n)]
    original = _healthy(losses, skipped)
    control = _judged(original, "control", _rerun(losses, status="complete", skipped=skipped))
    assert control.outcome == "diverged" and "skipped" in control.detail  # two in a row
    ex = Experiments()
    ex.runs = [control, _judged(original, "fp32", _rerun(losses, status="complete"))]
    assert silent_verdict(ex, original) is None
    assert control.outcome == "trained" and "4 skipped steps like the original run's" in \
        control.detail
    # a re-run stopped at --max-steps made only the first of the original's streaks: the same
    control = _judged(original, "control", _rerun(losses[:15], status="stopped",
                                                  skipped={10, 11}))
    ex = Experiments()
    ex.runs = [control, _judged(original, "fp32", _rerun(losses[:15], status="stopped"))]
    assert silent_verdict(ex, original) is None and control.outcome == "trained"
    # skips that come with a blown-up loss are no scaler cycle: a divergence
    blown = [1.0] * 15 + [20.0] * 15
    original = _healthy(blown, skipped)
    control = _judged(original, "control", _rerun(blown, status="complete", skipped=skipped))
    ex = Experiments()
    ex.runs = [control, _judged(original, "fp32", _rerun(losses, status="complete"))]
    found = silent_verdict(ex, original)
    assert found is not None and found.kind == "divergence" and found.step == 15  # 20 > 10x 1
    # skips the original did not have are the control's own: a divergence still
    original = _healthy(losses, {10, 11})
    control = _judged(original, "control", _rerun(losses, status="complete", skipped=skipped))
    ex = Experiments()
    ex.runs = [control, _judged(original, "fp32", _rerun(losses, status="complete"))]
    found = silent_verdict(ex, original)
    assert found is not None and found.kind == "divergence"


def test_a_rung_that_stayed_finite_but_did_not_learn_is_not_a_cure():
    """float32 everywhere ran to the horizon with finite losses, but its loss rose while the
    control's fell before the failure: not a precision verdict."""
    t = _original(8)
    ex = _ex(t, control="recurred")
    ex.runs[0].losses = [2.0 - 0.1 * i for i in range(8)]
    rising = Experiment(rung="fp32", fixes=["fp32-all"], outcome="trained",
                        losses=[2.0 + 0.1 * i for i in range(20)], steps=20, target_steps=20)
    ex.runs.append(rising)
    classify(ex, t)
    assert ex.verdict not in ("precision", "precision-range", "precision-resolution",
                              "loss-scaling"), ex.verdict_text
    assert "did not learn" in ex.verdict_text
    # the same rung learning is a cure
    ex = _ex(t, control="recurred")
    ex.runs[0].losses = [2.0 - 0.1 * i for i in range(8)]
    ex.runs.append(Experiment(rung="fp32", fixes=["fp32-all"], outcome="trained",
                              losses=[2.0 - 0.05 * i for i in range(20)], steps=20,
                              target_steps=20))
    classify(ex, t)
    assert ex.verdict.startswith("precision"), ex.verdict_text


def test_a_warmup_that_learns_more_than_the_control_by_a_material_share_is_a_finding():
    fp32 = _healthy([3.0] * 20)
    fp32.run = RunInfo(status="complete")
    control = Experiment(rung="control", outcome="trained", steps=20, target_steps=20,
                         losses=[3.0 - 0.03 * i for i in range(20)])  # 3.0 -> 2.43
    warm = Experiment(rung="warmup", fixes=["warmup=10"], outcome="trained", steps=20,
                      target_steps=20, losses=[3.0 - 0.08 * i for i in range(20)])  # -> 1.48
    ex = Experiments(runs=[control, warm], deterministic=True, spread=0.0)
    found = warmup_verdict(ex, fp32)
    assert found is not None and found.rule == "post-ln-warmup" and found.kind == "lr_too_high"
    # the gap over the last five steps, by hand: 0.05 x 17 = 0.85 (loss_gap's means)
    assert found.data["gap"] == pytest.approx(0.05 * 17) and found.data["warmup"] == 10
    assert ex.verdict == "optimisation"
    # a warm-up that only matches the control (within noise), or gains a sliver: no finding
    for losses in ([3.0 - 0.03 * i for i in range(20)], [3.0 - 0.031 * i for i in range(20)]):
        ex = Experiments(runs=[control, dataclasses.replace(warm, losses=losses)],
                         deterministic=True, spread=0.0)
        assert warmup_verdict(ex, fp32) is None and "no gain from a warm-up" in ex.verdict_text
    # a crashed warm-up says so
    ex = Experiments(runs=[control, dataclasses.replace(warm, outcome="crashed",
                                                        detail="re-run crashed: boom")])
    assert warmup_verdict(ex, fp32) is None and "crashed" in ex.verdict_text


def test_the_lr_rung_chosen_for_a_divergence_learned_and_made_no_failure_of_its_own():
    from nanhunt.experiment.verify import _learned_cleanly

    rising = Experiment(rung="lr-0.1", fixes=["lr-factor=0.1"], outcome="trained",
                        losses=[1.0 + 0.01 * i for i in range(20)])
    own = Experiment(rung="lr-0.1", fixes=["lr-factor=0.1"], outcome="trained",
                     detail="(its own diagnosis, not the original failure: logit growth) ",
                     losses=[1.0 - 0.01 * i for i in range(20)])
    good = Experiment(rung="lr-0.01", fixes=["lr-factor=0.01"], outcome="trained",
                      losses=[1.0 - 0.01 * i for i in range(20)])
    unknown = dataclasses.replace(good, losses=[1.0, None, 0.9, 0.8, 0.7])
    assert [_learned_cleanly(e) for e in (rising, own, good, unknown)] == \
        [False, False, True, False]


def test_the_growth_rung_lets_gradscaler_climb_to_the_measured_scale_by_half_the_failure():
    """A scale that started 8 binades too low (2^4 where the gradients' exponents call for
    2^12): growing every 40 // (2 x 8) = 2 steps, GradScaler gets there by step 16 of 40."""
    t = _original(40, kind="underflow")
    for s in t.steps:
        s.scale, s.skipped, s.loss = 16.0, False, 1.0  # no skipped step: the scale was low
    t.run.scaler_settings = {"init_scale": 16.0, "growth_interval": 2000}
    t.grad_hist = {"float16": {1: 10, -4: 100}}  # |g| < 4: 2^(15 - 1 - 2)
    assert measured_init_scale(t) == 2.0 ** 12
    assert measured_growth_interval(t, 2.0 ** 12, 40) == 2
    t.optimizers = [OptimizerInfo(type="SGD")]
    precision = _ladder(t, _rung("fp32", "trained"))
    precision.failure_step = 40
    rungs = {r.name: r.fixes for r in next_rungs(t, precision)}
    assert rungs["init-scale"] == ("init-scale=4096",)
    assert rungs["growth-interval"] == ("growth-interval=2",)
    # too early for any interval (8 doublings need 16 steps), a script that grows that often
    # already, and a scale that was too high (lowering it is init_scale's job): no rung
    assert measured_growth_interval(t, 2.0 ** 12, 15) is None
    t.run.scaler_settings = {"growth_interval": 2}
    assert measured_growth_interval(t, 2.0 ** 12, 40) is None
    assert measured_growth_interval(t, 8.0, 40) is None
    # its re-run training makes it loss scaling
    t.run.scaler_settings = {"growth_interval": 2000}
    ex = _ladder(t, _rung("fp32", "trained"), _rung("bf16", "trained", "bf16"),
                 _rung("init-scale", "recurred", "init-scale=4096", step=40),
                 _rung("growth-interval", "trained", "growth-interval=2"))
    classify(ex, t)
    assert ex.verdict == "loss-scaling" and "growing every 2 steps" in ex.verdict_text


def test_the_batch_rungs_reach_back_to_where_the_loss_blew_up():
    from nanhunt.experiment.ladder import batch_rungs, divergence_batch_rungs

    t = _original()
    ex = _ex(t, control="recurred")
    control = next(e for e in ex.runs if e.rung == "control")
    control.losses = [1.0, 0.9, 0.8, 0.7, 0.6, 25.0, 40.0, 30.0]  # blew up (10x) at step 5
    assert [r.fixes[0] for r in batch_rungs(ex, 7)] == ["skip-batch=7", "skip-batch=5",
                                                         "skip-batch=4"]
    assert [r.fixes[0] for r in batch_rungs(ex, 5)] == ["skip-batch=5"]  # no earlier onset
    control.losses = [1.0, 0.9, 0.8]
    assert [r.fixes[0] for r in batch_rungs(ex, 2)] == ["skip-batch=2"]
    assert batch_rungs(ex, 0) == []  # step 0 has no batch before it
    # a run with no failure found: only where its control diverged again
    assert divergence_batch_rungs(ex) == []
    control.outcome, control.losses = "diverged", [2.0, 1.5, 1.2, 30.0, 9.0]
    assert [r.fixes[0] for r in divergence_batch_rungs(ex)] == ["skip-batch=3", "skip-batch=2"]


def test_a_batch_is_the_cause_only_where_replacing_another_batch_did_not_cure():
    from nanhunt.experiment.ladder import cured_batch

    t = _original()
    ex = _ex(t, control="recurred", fp32="recurred")
    ex.runs += [Experiment(rung="skip-batch", outcome="trained", fixes=["skip-batch=3"],
                           losses=[1.0, 0.9, 0.8, 0.7], steps=24, target_steps=24),
                Experiment(rung="skip-batch", outcome="recurred", fixes=["skip-batch=1"])]
    assert cured_batch(ex) is not None and cured_batch(ex).fixes == ["skip-batch=3"]
    classify(ex, t)
    assert ex.verdict == "data" and "replacing step 3's batch removes it" in ex.verdict_text
    # every replaced batch removes it: a run sensitive to its data, no one batch to blame
    ex.runs[-1] = Experiment(rung="skip-batch", outcome="trained", fixes=["skip-batch=1"],
                             losses=[1.0, 0.9, 0.8, 0.7], steps=24, target_steps=24)
    assert cured_batch(ex) is None
    classify(ex, t)
    assert ex.verdict != "data" and "each removes it" in ex.verdict_text
