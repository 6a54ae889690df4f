"""Failures without a NaN through the real CLI, a cheap representative subset of
benchmarks/curves_matrix.py (every pattern in three architectures): each failing script exits 1
naming what an independent probe names (tests/scripts/curves_probe.py: forward hooks that
recompute the attention logits from each qkv projection, not from any softmax); the fix applied
by hand (the script's own flag) trains; healthy spiky runs stay quiet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "tests" / "scripts"
STEPS = ("--steps", "16")

ATTN = ("curves_gpt.py", *STEPS, "--hot", "qkv", "--hot-lr", "1")
HEAD = ("curves_vit.py", *STEPS, "--hot", "head", "--hot-lr", "10")
LR = ("curves_encoder.py", *STEPS, "--lr", "3")
STALL = ("curves_gpt.py", "--steps", "12", "--weights", "bf16", "--lr", "3e-4")
SCALER = ("curves_vit.py", "--steps", "30", "--precision", "fp16", "--growth-interval", "2")
SPIKE = ("curves_encoder.py", "--steps", "26", "--spike-at", "15", "--spike-lr", "10")
# a post-LN ViT at full lr from the first step: the loss jumps and settles at chance (ln 4)
POST_LN = ("curves_vit.py", "--steps", "24", "--post-ln", "--depth", "4", "--lr", "0.03")
# a post-LN GPT at full lr from the first step: its loss falls, so no rule of one
# run can call it failed (3.66 -> 2.86 in 20 steps); its warm-up experiment learns far more (1.5)
POST_LN_GPT = ("curves_gpt.py", "--steps", "20", "--post-ln", "--depth", "4", "--lr", "0.03")
# an encoder at lr 1: its loss swings between 1x and 100x its first value, never staying out
# long enough for the rule: the control and the learning-rate rungs say it diverged and why
CHAOS = ("curves_encoder.py", "--steps", "30", "--lr", "1")


def _diagnose(cli, script, *args):
    return cli.submit("diagnose", "--quiet", SCRIPTS / script, *args)


def prefetch(cli) -> dict:
    runs = {name: _diagnose(cli, *case) for name, case in
            [("attn", ATTN), ("head", HEAD), ("lr", LR), ("stall", STALL), ("scaler", SCALER),
             ("spike", SPIKE)]}
    runs["attn-fixed"] = _diagnose(cli, *ATTN, "--qk-norm")
    # the one re-run verification here: the warm-up fix through the experiment engine
    runs["post-ln"] = cli.submit("diagnose", "--quiet", "--verify", "1", "--max-steps", "12",
                                 SCRIPTS / POST_LN[0], *POST_LN[1:], verify=True)
    runs["chaos"] = cli.submit("diagnose", "--quiet", SCRIPTS / CHAOS[0], *CHAOS[1:],
                               verify=True)
    runs["attn-probe"] = cli.python(SCRIPTS / "curves_probe.py", *ATTN)
    runs["head-probe"] = cli.python(SCRIPTS / "curves_probe.py", *HEAD)
    return runs


@pytest.fixture(scope="module")
def runs(cli) -> dict:
    return prefetch(cli)


def _probe(proc) -> dict[str, dict[int, float]]:
    assert proc.returncode == 0, proc.stderr
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: {int(s): v for s, v in d.items()} for k, d in raw.items()}


def _first_to_cross(series: dict[str, dict[int, float]], limit: float = 100.0) -> str:
    """The rule's criterion, on the probe's own numbers: of the series that grew 10x to the
    limit, the first to cross it, the largest at that step."""
    best = None
    for name, by in series.items():
        pts = sorted(by.items())
        cross = next(((s, v) for s, v in pts if v >= limit), None)
        if cross is not None and cross[1] >= 10 * pts[0][1] and (
                best is None or (cross[0], -cross[1]) < (best[1], -best[2])):
            best = (name, cross[0], cross[1])
    assert best is not None, "the probe saw no logit growth"
    return best[0]


def _losses(res) -> list[float]:
    return _printed(res.stdout)


def _printed(stdout: str) -> list[float]:
    """The losses a curves script prints, ``step N loss X`` a line."""
    return [float(line.split()[-1]) for line in stdout.splitlines() if line.startswith("step ")]


def test_attention_logit_growth_names_the_attention_the_probe_names(runs):
    res = runs["attn"].result()
    assert res.code == 1, res.stderr
    d = res.report["diagnosis"]
    assert (d["rule"], d["kind"], d["phase"]) == ("logit-growth", "logit_growth", "forward")
    probe = _probe(runs["attn-probe"].result())
    assert d["module"] == _first_to_cross({k: v for k, v in probe.items() if k.endswith("attn")})
    # the param group of the attention projections is the one out of proportion
    assert d["data"]["group"] == "Adam[1]" and d["data"]["update_ratio"] >= 0.1
    recs = {r["type"]: r for r in res.report["recommendations"]}
    assert recs["qk_layernorm"]["module"] == d["module"]
    assert recs["qk_layernorm"]["code_change"] and not recs["qk_layernorm"]["verified"]
    assert "signal" in res.text and "largest attention logit" in res.text


def test_qk_layernorm_applied_by_hand_trains(runs):
    bad, fixed = runs["attn"].result(), runs["attn-fixed"].result()
    assert fixed.code == 0, fixed.stderr
    assert fixed.report["diagnosis"] is None
    assert _losses(fixed)[-1] < _losses(bad)[-1]


def test_output_logit_growth_names_the_head(runs):
    res = runs["head"].result()
    assert res.code == 1, res.stderr
    rep = res.report
    # the head's weights grew by about lr at every step (weight-growth, the diagnosis when the
    # loss paid for it) and its logits saturated the softmax (logit-growth): both name the head
    assert rep["diagnosis"]["module"] == "head"
    f = next(f for f in [rep["diagnosis"], *rep["warnings"]] if f["rule"] == "logit-growth")
    assert (f["kind"], f["data"]["signal"]) == ("logit_growth", "output_logit")
    probe = _probe(runs["head-probe"].result())
    assert f["module"] == _first_to_cross({"head": probe["head"]}) == "head"


def test_lr_far_too_high_without_nan_is_an_error(runs):
    res = runs["lr"].result()
    assert res.code == 1, res.stderr
    rep = res.report
    assert rep["first_failure"] is None
    assert rep["diagnosis"]["kind"] == "lr_too_high"
    # the divergence is the diagnosis, or explained by the weights growing by lr every step
    # (weight-growth, the more precise cause for Adam) and kept as a warning
    d = next(f for f in [rep["diagnosis"], *rep["warnings"]] if f["rule"] == "loss-divergence")
    assert d["kind"] == "lr_too_high" and d["data"]["update_ratio"] >= 0.1
    lower = next(r for r in rep["recommendations"] if r["type"] == "lower_lr")
    assert lower["fix"] == [f"lr-factor={lower['value']:g}"]
    # every applied step has its param group's signals
    applied = [s["index"] for s in rep["steps"]]
    assert [s["step"] for s in rep["signals"]] == applied


def test_bfloat16_updates_that_round_away_are_a_stall(runs):
    res = runs["stall"].result()
    assert res.code == 1, res.stderr
    d = res.report["diagnosis"]
    assert (d["rule"], d["kind"]) == ("loss-stall", "underflow")
    assert d["data"]["unchanged"] >= 0.5 and d["data"]["dtypes"] == ["bfloat16"]


def test_gradscaler_growth_then_backoff_is_quiet(runs):
    res = runs["scaler"].result()
    assert res.code == 0, res.stderr
    rep = res.report
    backoffs = [e for e in rep["scaler_events"] if e["event"] == "backoff"]
    assert len(backoffs) >= 3  # the scaler probed and backed off, again and again
    assert rep["diagnosis"] is None
    assert not {w["rule"] for w in rep["warnings"]} & {"skip-streak", "scale-backoff"}


def test_a_spike_that_recovers_is_at_most_a_warning_with_its_step(runs):
    res = runs["spike"].result()
    assert res.code == 0, res.stderr
    rep = res.report
    assert rep["diagnosis"] is None
    (w,) = [w for w in rep["warnings"] if w["rule"] == "loss-spike"]
    assert w["severity"] == "warning" and w["step"] == 16 and w["data"]["recovered"] is not None


def test_a_post_ln_transformer_without_warmup_is_named_and_its_warmup_verified(runs):
    res = runs["post-ln"].result()
    assert res.code == 1, res.stderr
    rep = res.report
    d = rep["diagnosis"]
    assert (d["rule"], d["kind"], d["module"]) == ("post-ln-warmup", "lr_too_high",
                                                   "trunk.blocks.0")
    assert d["data"]["blocks"] == [f"trunk.blocks.{i}" for i in range(4)]
    # the warm-up length from the script's Adam (torch's default betas): 2 / (1 - 0.999)
    assert rep["optimizers"][0]["beta2"] == 0.999
    warm = next(r for r in rep["recommendations"] if r["type"] == "lr_warmup")
    assert warm["fix"] == ["warmup=2000"] and warm["verified"]
    ex = rep["experiments"]
    runs_by = {e["rung"]: e for e in ex["runs"]}
    # control first, reproducing the failure; the fix verified by every condition it could meet
    assert ex["runs"][0]["rung"] == "control" and ex["control_reproduced"]
    assert runs_by["fix"]["fixes"] == ["warmup=2000"] and runs_by["fix"]["outcome"] == "trained"
    held = warm["tries"][-1]["conditions"]
    assert held["control_reproduced"] and held["past_horizon"] and held["finite"]
    # the run is float32: a lower learning rate training makes it an optimisation failure
    assert ex["verdict"] == "optimisation", ex["verdict_text"]
    # the warmed-up re-run ends below the control, which stays near chance (ln 4 = 1.39)
    assert runs_by["fix"]["losses"][-1] < runs_by["control"]["losses"][-1] - 0.2


def _tail_mean(losses: list[float], k: int = 5) -> float:
    return sum(losses[-k:]) / k


@pytest.mark.slow  # the post-LN encoder above runs the warm-up experiment in the default suite
def test_a_post_ln_gpt_that_learns_less_without_warmup_is_shown_by_its_warmup_experiment(
        runs, cli):
    # the experiments of a run with no failure found (default --verify)
    res = cli.submit("diagnose", "--quiet", SCRIPTS / POST_LN_GPT[0], *POST_LN_GPT[1:],
                     verify=True).result()
    assert res.code == 1, res.stderr
    rep = res.report
    d = rep["diagnosis"]
    assert (d["rule"], d["kind"], d["module"]) == ("post-ln-warmup", "lr_too_high",
                                                   "trunk.blocks.0")
    ex = rep["experiments"]
    by = {e["rung"]: e for e in ex["runs"]}
    assert set(by) == {"control", "warmup"} and ex["verdict"] == "optimisation"
    # the control is the original run again (a deterministic script): the same losses
    original = _losses(res)
    assert by["control"]["losses"] == pytest.approx(original, rel=1e-5)
    warm = rep["recommendations"][0]
    assert warm["type"] == "lr_warmup" and warm["verified"], warm["verification"]
    k = warm["value"]
    assert warm["fix"] == [f"warmup={k}"] and k == 10  # half of the 20-step run
    # the script's own warm-up flag (its code, not nanhunt's fix), run by hand, learns more
    hand = cli.python(SCRIPTS / POST_LN_GPT[0], *POST_LN_GPT[1:], "--warmup", str(k)).result()
    assert hand.returncode == 0, hand.stderr
    warmed = _printed(hand.stdout)
    assert len(warmed) == len(original) == 20
    assert _tail_mean(warmed) < _tail_mean(original) - 0.5, (warmed, original)


def test_a_loss_that_swings_far_above_its_start_is_a_divergence_and_a_lower_lr_trains(
        runs, cli):
    res = runs["chaos"].result()
    original = _losses(res)
    # by hand: the loss went above 10x its first value and never came back near it for long
    assert max(original) > 10 * original[0]
    assert res.code == 1, res.stderr
    rep = res.report
    d = rep["diagnosis"]
    assert (d["rule"], d["kind"]) == ("experiment-divergence", "lr_too_high")
    assert d["step"] == next(i for i, v in enumerate(original) if v > 10 * original[0])
    ex = rep["experiments"]
    by = {e["rung"]: e for e in ex["runs"]}
    assert by["control"]["outcome"] == "diverged" and ex["verdict"] == "optimisation"
    lower = rep["recommendations"][0]
    assert lower["type"] == "lower_lr" and lower["verified"], lower["verification"]
    factor = float(lower["value"])
    # the fix is the rung's own re-run: the first factor that trained and learned
    rung = next(e for e in ex["runs"] if e["fixes"] == lower["fix"])
    assert rung["rung"] in ("lr-0.1", "lr-0.01") and rung["outcome"] == "trained"
    # the factor applied by hand through the script's own --lr: it trains (stays under 10x its
    # first loss) and learns (its last losses below its first)
    hand = cli.python(SCRIPTS / CHAOS[0], *CHAOS[1:-1], str(1 * factor)).result()
    assert hand.returncode == 0, hand.stderr
    fixed = _printed(hand.stdout)
    assert len(fixed) == 30 and max(fixed) < 10 * fixed[0]
    assert _tail_mean(fixed) < fixed[0]
