"""Failures without a NaN (nanhunt/analyse/diagnose/curves.py) on hand-built traces, and
GradScaler's growth-then-backoff cycle judged on a simulated scaler (risks.py)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from nanhunt.analyse.diagnose import curves, diagnose
from nanhunt.trace import (
    GroupSignal,
    LayerStats,
    ParamGroupInfo,
    RunInfo,
    ScalerEvent,
    SignalStep,
    StepRecord,
    Trace,
)


def trace_of(losses, *, layers=(), signals=(), groups=(), scale=None, skipped=(), events=()):
    steps = [StepRecord(index=i, loss=v, grad_norm=1.0, skipped=i in skipped,
                        scale=scale[i] if scale else None) for i, v in enumerate(losses)]
    t = Trace(run=RunInfo(target="float32", scaler=bool(scale)), steps=steps,
              layers=list(layers), signals=list(signals), param_groups=list(groups),
              scaler_events=list(events))
    diagnose(t, strict=True)
    return t


def lay(name, type_="Linear", *, fwd=(), logits=(), params=10):
    return LayerStats(module=name, type=type_, calls=len(fwd), params=params,
                      forward_amax_by_step=dict(enumerate(fwd)),
                      logit_amax_by_step=dict(enumerate(logits)))


def falling(n, start=3.0, rate=0.05, noise=0.02, seed=0):
    rng = random.Random(seed)
    return [start * math.exp(-rate * i) * (1 + noise * rng.uniform(-1, 1)) for i in range(n)]


def by_rule(t, rule):
    found = [f for f in [t.diagnosis, *t.warnings] if f is not None and f.rule == rule]
    return found


# ----------------------------------------------------------------------------- healthy curves


@pytest.mark.parametrize("seed", range(5))
def test_a_falling_noisy_loss_is_quiet(seed):
    t = trace_of(falling(60, noise=0.1, seed=seed))
    assert t.diagnosis is None
    assert not by_rule(t, "loss-spike")


def test_warmup_transient_is_quiet():
    # the loss rises for three steps while the lr warms up, then falls below where it started
    losses = [2.0, 2.4, 2.7, 2.9, 2.5, 2.1, *falling(30, start=1.9)]
    t = trace_of(losses)
    assert t.diagnosis is None


def test_cosine_restarts_are_quiet():
    # a saw-tooth: each restart lifts the loss back, never near the start and never 2x its
    # recent median
    losses = []
    for cycle in range(5):
        losses += [1.0 / (1 + cycle) + 0.4 * math.cos(math.pi * i / 10) ** 2 for i in range(10)]
    t = trace_of([3.0, 2.5, 2.0, *losses])
    assert t.diagnosis is None


def test_a_spike_that_recovers_is_a_warning_with_its_step():
    losses = falling(30)
    losses[15] *= 6
    t = trace_of(losses)
    assert t.diagnosis is None
    (w,) = by_rule(t, "loss-spike")
    assert (w.severity, w.step, w.data["recovered"]) == ("warning", 15, 16)
    assert "recovered by itself at step 16" in w.message


def test_a_spike_at_the_end_says_recovery_was_not_observed():
    losses = falling(30)
    losses[27:] = [v * 8 for v in losses[27:]]
    t = trace_of(losses)
    (w,) = by_rule(t, "loss-spike")
    assert w.severity == "warning" and w.step == 27
    assert "before nanhunt could see whether it recovers" in w.message


# ----------------------------------------------------------------------------- failures


def test_a_spike_that_does_not_recover_is_an_error_naming_the_first_mover():
    n = 30
    losses = falling(12) + [v * 3 for v in falling(n - 12, start=3.0 * math.exp(-0.6))]
    # blocks.1.attn's attention logits move at step 9, before the loss spikes at 12; the
    # output layer's output moves only at 11
    layers = [
        lay("emb", "Embedding", fwd=[1.0] * n),
        lay("blocks.0.attn", "Attention", fwd=[1.0] * n, logits=[1.5] * n, params=0),
        lay("blocks.1.attn", "Attention", fwd=[1.0] * n, params=0,
            logits=[1.6] * 9 + [40.0, 300.0, 3e4] + [3e4] * (n - 12)),
        lay("head", fwd=[2.0] * 11 + [20.0] * (n - 11)),
    ]
    t = trace_of(losses, layers=layers)
    d = t.diagnosis
    assert d is not None and d.severity == "error"
    assert d.rule in ("loss-spike", "logit-growth")
    assert (d.kind, d.module) == ("logit_growth", "blocks.1.attn")
    spike = by_rule(t, "loss-spike")[0]
    assert spike.step == 12 and spike.data["recovered"] is None
    assert "grew from 1.6 (step 0) to 3e+04" in " ".join(spike.evidence)


def test_divergence_is_an_error_and_the_update_ratio_names_the_group():
    n = 20
    losses = [2.0, 1.9, 1.8] + [1.8 * 1.3**i for i in range(1, n - 2)]
    signals = [SignalStep(i, [GroupSignal("Adam[0]", weight_norm=10.0, update_norm=0.01, lr=1e-3),
                              GroupSignal("Adam[1]", weight_norm=2.0, update_norm=1.0, lr=1.0)])
               for i in range(n)]
    t = trace_of(losses, signals=signals)
    d = t.diagnosis
    assert (d.rule, d.kind, d.severity) == ("loss-divergence", "lr_too_high", "error")
    assert d.data["group"] == "Adam[1]" and d.data["update_ratio"] == pytest.approx(0.5)
    assert d.data["onset"] == 4  # 1.8 * 1.3**2 = 3.04 >= 1.5 * 1.8 first at step 4


def test_a_noisy_stationary_loss_rarely_diverges():
    """Losses drawn independently around one level (a healthy run on small random batches: most
    draws of a scaled chi-square lie well below its mean) diverge only when the last five or more
    happen to exceed every loss before them: for 12 exchangeable draws that is the chance that
    the largest 12-k are the last ones, summed over where the run starts (k >= 3), about 1%.
    "1.5x the lowest of the first three" fired on about a fifth of them. The same draws with the
    level tripled from step 8 are a divergence from step 8, and a plateau at 50x the early loss
    after a spike higher still is one too."""
    rng = np.random.default_rng(0)
    chance = sum(math.factorial(k) * math.factorial(12 - k) / math.factorial(12)
                 for k in range(3, 8))
    assert chance < 0.011
    alarms = 0
    trials = 2000
    for _ in range(trials):
        draws = rng.chisquare(4, size=12) / 4
        alarms += curves.divergence(list(enumerate(draws.tolist()))) is not None
    assert alarms <= 2 * chance * trials
    risen = [(i, 3.0 + 0.01 * i if i >= 8 else 1.0 + 0.01 * (i % 2)) for i in range(14)]
    d = curves.divergence(risen)
    assert d is not None and d.onset == 8 and d.steps == 6
    # an lr far too high: one early spike above the plateau the loss then stays on
    spiked = list(enumerate([0.7, 0.69, 543.0, 35.0, 60.0, 160.0, 90.0, 40.0, 100.0, 80.0]))
    d = curves.divergence(spiked)
    assert d is not None and d.onset == 2 and d.steps == 8  # never back under 10x 0.7
    # a run that left at its first update: the median of the first three had already diverged
    left = list(enumerate([0.70, 53.0, 544.0, 165.0, 35.0, 409.0, 196.0, 54.0, 160.0, 46.0]))
    d = curves.divergence(left)
    assert d is not None and (d.onset, d.early) == (1, 0.70)
    # ... and one that only came back to ten times its first loss did not stay out
    back = list(enumerate([0.70, 53.0, 544.0, 165.0, 35.0, 6.0, 196.0, 54.0, 160.0, 46.0, 50.0]))
    assert curves.divergence(back).onset == 6


def test_the_whole_model_moving_at_once_is_the_learning_rate():
    n = 14
    losses = [3.0, 2.9, 3.1] + [30.0 + i for i in range(n - 3)]
    layers = [lay(f"l{i}", fwd=[1.0] * 3 + [50.0 + i] * (n - 3)) for i in range(4)]
    layers[1].logit_amax_by_step = {i: (1.0 if i < 3 else 500.0) for i in range(n)}
    t = trace_of(losses, layers=layers)
    d = t.diagnosis
    assert (d.rule, d.kind, d.module) == ("loss-divergence", "lr_too_high", None)
    assert any("4 of the 4 modules with weights" in e for e in d.evidence)
    assert by_rule(t, "logit-growth")[0].severity == "warning"


def test_output_logit_growth_names_the_head():
    n = 20
    layers = [lay("body", fwd=[1.0] * n), lay("norm", "LayerNorm", fwd=[1.0] * n),
              lay("head", fwd=[2.0, 2.0, 2.5] + [150.0 + i for i in range(n - 3)]),
              lay("model", "Net", fwd=[2.0, 2.0, 2.5] + [150.0 + i for i in range(n - 3)],
                  params=0)]
    t = trace_of(falling(n), layers=layers)
    d = t.diagnosis
    assert (d.rule, d.kind, d.module) == ("logit-growth", "logit_growth", "head")
    assert d.data["signal"] == "output_logit" and d.step == 3


def test_output_logit_growth_advises_a_z_loss_and_attention_a_qk_layernorm():
    from nanhunt.analyse.advise import advise

    n = 20
    head = [2.0, 2.0, 2.5] + [150.0 + i for i in range(n - 3)]
    t = trace_of(falling(n), layers=[lay("body", fwd=[1.0] * n), lay("head", fwd=head)])
    advise(t)
    z = next(r for r in t.recommendations if r.type == "z_loss")
    loss = dict(curves.losses(t))
    # strong enough at the grown logits (the term reaches the loss there), under 1% of the first
    # loss at the first logits: PaLM's 1e-4 is both here
    assert z.value * max(head) ** 2 >= loss[3] and z.value * head[0] ** 2 <= 0.01 * loss[0]
    assert z.value == 1e-4 and z.fix == ["zloss:head=0.0001"] and not z.code_change
    assert "logsumexp(-1).pow(2)" in z.snippet
    t = trace_of(falling(n), layers=[
        lay("blocks.0.attn", "Attention", fwd=[1.0] * n, logits=[1.5] + [500.0] * (n - 1)),
        lay("head", fwd=[2.0] * n)])
    advise(t)
    qk = next(r for r in t.recommendations if r.type == "qk_layernorm")
    assert qk.module == "blocks.0.attn" and "q_norm" in qk.snippet and not qk.verified
    cap = next(r for r in t.recommendations if r.type == "logit_cap")
    assert cap.fix == ["cap:blocks.0.attn=20"]  # 4x the first logit 1.5 is 6: at least 20
    assert "torch.tanh(att / 20)" in cap.snippet


@pytest.mark.parametrize(("healthy", "grown", "loss", "want"), [
    (1.0, 100.0, 3.0, 1e-3),  # 1e-4 x 100^2 = 1 < 3: too weak; 1e-3 reaches it
    (20.0, 1e4, 3.0, 1e-5),  # 1e-4 x 20^2 = 0.04 > 1% of 3: too strong for healthy logits
    (2.0, 200.0, 3.0, 1e-4),  # PaLM's: 4 at the grown logits, 4e-4 at the first
])
def test_z_loss_coefficient_between_pushing_back_and_leaving_healthy_logits(
        healthy, grown, loss, want):
    from nanhunt.analyse.curve_advice import z_loss_coef

    coef, low, high = z_loss_coef(healthy, grown, loss, loss)
    assert low <= coef <= high
    assert coef == want
    assert coef * grown ** 2 >= loss and coef * healthy ** 2 <= 0.01 * loss


def test_healthy_logits_in_the_tens_are_quiet():
    n = 20
    layers = [lay("attn", "Attention", fwd=[1.0] * n, logits=[1.5 + i for i in range(n)]),
              lay("head", fwd=[2.0 + i for i in range(n)])]
    t = trace_of(falling(n), layers=layers)
    assert t.diagnosis is None and not by_rule(t, "logit-growth")


def _stall_signals(dtype, unchanged):
    sig = [SignalStep(i, [GroupSignal("Adam[0]", weight_norm=5.0, update_norm=0.001,
                                      unchanged=unchanged)]) for i in range(10)]
    return sig, [ParamGroupInfo("Adam[0]", "Adam", 0, tensors=4, elements=1000, dtypes=[dtype])]


def test_updates_that_round_away_in_bfloat16_are_a_stall():
    sig, groups = _stall_signals("bfloat16", 0.9)
    t = trace_of(falling(10, rate=0.001), signals=sig, groups=groups)
    d = t.diagnosis
    assert (d.rule, d.kind, d.data["group"]) == ("loss-stall", "underflow", "Adam[0]")
    assert d.data["unchanged"] == pytest.approx(0.9)


def test_unchanged_float32_weights_are_no_stall():
    sig, groups = _stall_signals("float32", 0.9)  # (frozen rows of an embedding, say)
    assert trace_of(falling(10), signals=sig, groups=groups).diagnosis is None
    sig, groups = _stall_signals("bfloat16", 0.1)
    assert trace_of(falling(10), signals=sig, groups=groups).diagnosis is None


def test_stall_against_a_float32_reference():
    t = trace_of([3.0, 2.9, 2.85, 2.8, 2.8])
    ref = [(i, v) for i, v in enumerate([3.0, 2.5, 2.0, 1.6, 1.3])]
    f = curves.stall_against(t, ref, noise=0.1)
    assert (f.rule, f.kind, f.severity) == ("loss-stall", "underflow", "error")
    assert f.data["gap"] == pytest.approx(1.5)
    assert curves.stall_against(t, ref, noise=2.0) is None


# ----------------------------------------------------------------------------- GradScaler


def simulate_scaler(grad_amax, growth_interval, init_scale=2.0**16, fmax=65504.0):
    """torch.amp.GradScaler's update rule on a series of unscaled gradient maxima: a step whose
    scaled maximum exceeds fmax is skipped and halves the scale; growth_interval clean steps in
    a row double it. Returns (scales, skipped, events)."""
    scale, clean, scales, skipped, events = init_scale, 0, [], set(), []
    for i, g in enumerate(grad_amax):
        scales.append(scale)
        if g * scale > fmax:
            skipped.add(i)
            events.append(ScalerEvent(i, "backoff", scale, scale / 2))
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == growth_interval:
                events.append(ScalerEvent(i, "growth", scale, scale * 2))
                scale, clean = scale * 2, 0
    return scales, skipped, events


@pytest.mark.parametrize("interval", [2, 3, 5, 7, 10])
def test_growth_then_backoff_is_quiet_at_any_growth_interval(interval):
    rng = random.Random(interval)
    grads = [0.05 * (1 + 0.5 * rng.random()) for _ in range(80)]  # steady, noisy gradients
    scales, skipped, events = simulate_scaler(grads, interval)
    assert sum(e.event == "backoff" for e in events) >= 3  # the scaler did probe and back off
    t = trace_of(falling(80), scale=scales, skipped=skipped, events=events)
    assert t.diagnosis is None
    assert not by_rule(t, "scale-backoff") and not by_rule(t, "skip-streak")


def test_gradients_that_outgrow_the_scale_are_still_an_error():
    grads = [0.05 * 1.08**i for i in range(60)]  # 100x over the run: the scale must keep falling
    scales, skipped, events = simulate_scaler(grads, 4)
    t = trace_of(falling(60), scale=scales, skipped=skipped, events=events)
    (f,) = by_rule(t, "skip-streak")
    assert f.severity == "error"
    assert "below every level it had held" in f.message


# ----------------------------------------------------------------------------- the report


def _attention_trace():
    n = 30
    losses = falling(12) + [v * 3 for v in falling(n - 12, start=3.0 * math.exp(-0.6))]
    layers = [lay("emb", "Embedding", fwd=[1.0] * n),
              lay("blocks.1.attn", "Attention", fwd=[1.0] * n, params=0,
                  logits=[1.6] * 9 + [40.0, 300.0, 3e4] + [3e4] * (n - 12)),
              lay("head", fwd=[2.0] * n)]
    signals = [SignalStep(i, [GroupSignal("Adam[0]", weight_norm=4.0, update_norm=0.4)])
               for i in range(n)]
    return trace_of(losses, layers=layers, signals=signals)


def test_terminal_sparklines_put_the_signal_on_the_loss_steps():
    import io

    from rich.console import Console

    from nanhunt.report.terminal import render_terminal

    out = io.StringIO()
    render_terminal(_attention_trace(), Console(file=out, width=80, color_system=None))
    lines = out.getvalue().splitlines()
    loss = next(ln for ln in lines if ln.startswith("loss "))
    signal = next(ln for ln in lines if ln.startswith("signal "))
    assert "steps 0-29" in loss and "step 10 marked" in loss
    assert "largest attention logit in blocks.1.attn: 1.6 -> 3e+04" in signal
    # one bar per step, the jump where the logits jumped (log scale: 1.6 to 3e4)
    bars = signal.split()[1]
    assert len(bars) == 30 and bars[:9] == "▁" * 9 and bars[11:] == "█" * 19


def test_html_and_tensorboard_carry_the_signals(tmp_path):
    from nanhunt.report.html import render_html
    from nanhunt.report.tensorboard import export_tensorboard

    t = _attention_trace()
    page = render_html(t)
    assert "Largest attention logit in blocks.1.attn" in page
    assert "Update-to-weight ratio of Adam[0]" in page
    assert "the step the finding names" in page
    n = export_tensorboard(t, tmp_path)
    t.signals = []
    for layer in t.layers:
        layer.logit_amax_by_step = {}
    plain = export_tensorboard(t, tmp_path / "plain")
    assert n - plain == 30 * 3 + 30  # update_ratio, weight and update norms; the logits


# ----------------------------------------------------------------------------- a stall by slope


def _lined(losses, lrs=None, skipped=()):
    steps = [StepRecord(index=i, loss=v, grad_norm=1.0, skipped=i in skipped,
                        lr=lrs[i] if lrs else None) for i, v in enumerate(losses)]
    t = Trace(run=RunInfo(target="float32"), steps=steps)
    diagnose(t, strict=True)
    return t


def _stalled(seed=0, at=20, n=36, noise=0.02):
    rng = random.Random(seed)
    fall = [3.0 - 0.05 * i + noise * rng.uniform(-1, 1) for i in range(at)]
    return fall + [3.0 - 0.05 * at + noise * rng.uniform(-1, 1) for _ in range(n - at)]


@pytest.mark.parametrize("seed", range(3))
def test_a_loss_that_stops_falling_at_its_pace_is_a_stall(seed):
    t = _lined(_stalled(seed), lrs=[1e-3] * 36)
    d = t.diagnosis
    # step 20 is the first flat one and on the falling line too: either is the break
    assert (d.rule, d.kind) == ("loss-plateau", "stall") and d.step in (20, 21)
    # the pace the test built: 0.05 a step; the line it would have followed: 2.0 - 0.05 x 8
    assert d.data["pace"] == pytest.approx(-0.05, rel=0.1)
    assert abs(d.data["flat"]) < 0.01
    assert d.data["level"] == pytest.approx(2.0, abs=0.03)
    assert "would have reached 1.6" in d.message or "would have reached 1.5" in d.message


def test_a_loss_slowing_into_its_floor_is_no_stall():
    """Exponential decays (four rates, 2% and 10% noise; 0 of 1600 alarmed when measured)."""
    alarms = sum(curves.stall(list(enumerate(falling(60, rate=r, noise=nz, seed=s))))
                 is not None for s in range(30) for r in (0.02, 0.05, 0.1, 0.2)
                 for nz in (0.02, 0.1))
    assert alarms == 0


def test_a_stationary_noisy_loss_is_no_stall():
    rng = np.random.default_rng(0)
    assert not any(curves.stall(list(enumerate((2 + 0.3 * rng.standard_normal(50)).tolist())))
                   for _ in range(200))


def test_a_schedule_that_cuts_the_lr_flattens_the_loss_quietly():
    lrs = [1e-3] * 20 + [1e-5] * 16  # a step decay x0.01 at step 20
    assert _lined(_stalled(), lrs=lrs).diagnosis is None
    # cosine with warm restarts every 12 steps: each cycle falls, then flattens as lr -> 0
    lr = [1e-3 * 0.5 * (1 + math.cos(math.pi * (i % 12) / 12)) for i in range(48)]
    loss, v = [], 3.0
    for i in range(48):
        v -= 50 * lr[i] * 0.05 * v
        loss.append(v * (1 + 0.01 * math.sin(i)))
    assert _lined(loss, lrs=lr).diagnosis is None


def test_warmup_a_recovering_spike_and_scaler_skips_are_no_stall():
    rng = random.Random(1)
    warm = [3.0 - 0.004 * i * i + 0.02 * rng.uniform(-1, 1) for i in range(12)]
    line = [warm[-1] - 0.05 * i + 0.02 * rng.uniform(-1, 1) for i in range(1, 25)]
    assert _lined(warm + line).diagnosis is None
    spiked = [3.0 - 0.05 * i + 0.02 * rng.uniform(-1, 1) for i in range(40)]
    spiked[18] *= 3  # recovers at once
    t = _lined(spiked)
    assert t.diagnosis is None and not by_rule(t, "loss-plateau")
    # GradScaler with growth_interval 2: every third step skipped, its loss the previous one's
    skips = {i for i in range(40) if i % 3 == 2}
    stairs, v = [], 3.0
    for i in range(40):
        v -= 0 if i in skips else 0.05
        stairs.append(v + 0.02 * rng.uniform(-1, 1))
    assert _lined(stairs, skipped=skips).diagnosis is None


def test_a_stall_explained_by_saturating_attention_names_the_module():
    n = 36
    layers = [lay("blocks.0.attn", "Attention", fwd=[1.0] * n,
                  logits=[1.5] * 14 + [300.0] * (n - 14)),
              lay("blocks.1.attn", "Attention", fwd=[1.0] * n, logits=[1.5] * n),
              lay("head", fwd=[2.0] * n)]
    t = trace_of(_stalled(), layers=layers)
    f = by_rule(t, "loss-plateau")[0]
    assert (f.kind, f.module) == ("logit_growth", "blocks.0.attn")


# ----------------------------------------------------------------------------- post-LN, no warm-up


def _transformer_layers(post_ln, n):
    """Two blocks' layers in the order their calls return: post-LN runs attn, ln1, mlp, ln2;
    pre-LN ln1, attn, ln2, mlp."""
    out = []
    for b in range(2):
        p = f"blocks.{b}"
        attn = [lay(f"{p}.attn.qkv", fwd=[1.0] * n), lay(f"{p}.attn", "Attention", params=0,
                                                         fwd=[1.0] * n, logits=[2.0] * n)]
        mlp = [lay(f"{p}.mlp.0", fwd=[1.0] * n), lay(f"{p}.mlp", "Sequential", params=0,
                                                     fwd=[1.0] * n)]
        ln1, ln2 = lay(f"{p}.ln1", "LayerNorm", fwd=[1.0] * n), lay(f"{p}.ln2", "LayerNorm",
                                                                       fwd=[1.0] * n)
        kids = [*attn, ln1, *mlp, ln2] if post_ln else [ln1, *attn, ln2, *mlp]
        out += [*kids, lay(p, "Block", params=0, fwd=[1.0] * n)]
    return [*out, lay("head", fwd=[1.0] * n)]


def _run(post_ln, lrs, losses, opt_beta2=None):
    from nanhunt.analyse.advise import advise
    from nanhunt.trace import OptimizerInfo

    steps = [StepRecord(index=i, loss=v, grad_norm=1.0, lr=lrs[i]) for i, v in enumerate(losses)]
    t = Trace(run=RunInfo(target="float32"), steps=steps,
              layers=_transformer_layers(post_ln, len(losses)),
              optimizers=[OptimizerInfo("Adam", lr=lrs[0], beta2=opt_beta2)])
    diagnose(t, strict=True)
    advise(t)
    return t


def _stuck(n=24):
    rng = random.Random(3)
    return [1.25, 0.9, 2.6, 1.9] + [1.4 + 0.03 * rng.uniform(-1, 1) for _ in range(n - 4)]


def test_a_post_ln_transformer_without_warmup_that_does_not_learn_is_named():
    t = _run(True, [0.03] * 24, _stuck(), opt_beta2=0.98)
    d = t.diagnosis
    assert (d.rule, d.kind, d.module) == ("post-ln-warmup", "lr_too_high", "blocks.0")
    assert d.data["blocks"] == ["blocks.0", "blocks.1"]
    assert any("attn, ln1, mlp, ln2" in e for e in d.evidence)
    warm = next(r for r in t.recommendations if r.type == "lr_warmup")
    # Adam's second-moment horizon 2 / (1 - beta2) with the script's beta2 0.98: 100 steps
    assert warm.value == 100 and warm.fix == ["warmup=100"] and not warm.code_change
    assert "add_lr_warmup(optimizer, 100)" in warm.snippet


def test_pre_ln_or_a_warmup_or_a_loss_that_falls_is_no_post_ln_finding():
    assert not by_rule(_run(False, [0.03] * 24, _stuck()), "post-ln-warmup")
    warming = [0.03 * min(1.0, (i + 1) / 10) for i in range(24)]
    assert not by_rule(_run(True, warming, _stuck()), "post-ln-warmup")
    assert not by_rule(_run(True, [0.03] * 24, falling(24)), "post-ln-warmup")


def test_the_cap_widens_to_the_sibling_attentions_then_lowers():
    from nanhunt.analyse.remedies import ladder
    from nanhunt.trace import Recommendation

    rec = Recommendation(type="logit_cap", value=20.0, snippet="", module="trunk.blocks.0.attn",
                         fix=["cap:trunk.blocks.0.attn=20"])
    assert ladder(rec, Trace(run=RunInfo())) == [
        ["cap:trunk.blocks.0.attn=20"], ["cap:trunk.blocks.*.attn=20"],
        ["cap:trunk.blocks.*.attn=10"]]
