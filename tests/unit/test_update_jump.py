"""A learning rate so high that one optimizer step replaces the weights (nanoGPT at lr 1e20,
pytorch/examples' mnist at 1e30, issue 21): the forward after it overflows float32 in a float32
run, where no float32 region can help. The diagnosis is the update, from the param group's
signals; the reference is the weights' norms before and after the step, measured here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt.pipeline import analyse


def train(lr, session=None, spike_at=None, norms=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    x, y = torch.randn(16, 8), torch.randn(16, 1)

    def norm():
        return float(torch.cat([p.detach().double().flatten() for p in model.parameters()]).norm())

    with session(model, opt) if session else nanhunt.watch(model, opt) as hunt:
        for step in range(4):
            batch = x * 1e25 if step == spike_at else x  # LayerNorm's variance overflows
            before = norm()
            loss = nn.functional.mse_loss(model(batch), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if norms is not None:
                norms.append((before, norm()))
    return analyse(hunt.trace(), hunt.snapshot)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_update_that_replaced_the_weights_is_the_diagnosis(mode):
    norms = []
    session = None if mode == "full" else (
        lambda m, o: nanhunt.sentinel(m, o, out=None, stop=False))
    trace = train(1e20, session, norms=norms)
    before, after = norms[0]
    assert after > 1e6 * before  # the reference: step 0's update replaced the weights
    f = trace.first_failure
    assert (f.step, f.phase) == (1, "forward")
    d = trace.diagnosis
    assert (d.rule, d.kind, d.step, d.phase) == ("update-jump", "lr_too_high", 0, "optimizer")
    assert f"{after:.3g}"[:3] in d.evidence[0]
    recs = [r.type for r in trace.recommendations]
    assert "fp32_module" not in recs and recs[0] == "lower_lr"
    # the computed cut (the weights before step 0 are measured: no least-cut guess), applied
    # to the same training, trains: every step finite, each update a small share of the weights
    factor = trace.recommendations[0].value
    assert factor < 1e-3 and "before it" in trace.recommendations[0].evidence[0]
    fixed, fixed_norms = train(1e20 * factor, norms=[]), []
    assert fixed.first_failure is None and fixed.diagnosis is None
    assert all(s.loss is not None and s.loss == s.loss for s in fixed.steps)
    ratios = [g.update_ratio for st in fixed.signals for g in st.groups]
    assert max(ratios) < 0.1, ratios


def test_a_forward_overflow_after_healthy_updates_is_not_the_learning_rate():
    trace = train(1e-3, spike_at=2)
    assert (trace.first_failure.step, trace.first_failure.phase) == (2, "forward")
    assert trace.diagnosis.rule != "update-jump"


def test_a_step_with_a_closure_is_measured_after_the_closure_made_its_gradients():
    """optimizer.step(closure) (Lightning's automatic optimisation, LBFGS): the forward and
    backward run inside the step, so before it there are no gradients to measure; the
    signals of step 0 must still be there, and the jump read from them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e20)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    losses = []

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with nanhunt.watch(model, opt) as hunt:
        for _ in range(3):
            losses.append(opt.step(closure))
    assert all(isinstance(v, torch.Tensor) for v in losses)  # what the closure returned
    trace = analyse(hunt.trace(), hunt.snapshot)
    assert [st.step for st in trace.signals][:1] == [0]
    assert trace.diagnosis.rule == "update-jump" and trace.diagnosis.step == 0


def test_the_weights_norm_before_each_update_is_recorded():
    norms = []
    trace = train(1e-3, norms=norms)
    got = [(st.groups[0].weight_norm_before, st.groups[0].weight_norm) for st in trace.signals]
    assert len(got) == len(norms) == 4
    for (before, after), (ref_before, ref_after) in zip(got, norms):
        assert before == pytest.approx(ref_before, rel=1e-9)
        assert after == pytest.approx(ref_after, rel=1e-9)


def _signals(*steps):
    from nanhunt.trace import GroupSignal, SignalStep

    return [SignalStep(i, [GroupSignal(group="AdamW[0]", weight_norm_before=b, weight_norm=a,
                                       update_norm=u, lr=1.0)])
            for i, (b, a, u) in enumerate(steps)]


def test_a_jump_two_steps_before_the_failure_is_the_step_that_wrote_the_weights():
    """nanoGPT compiled at lr 1e20: step 0 replaced the weights (2.7 -> 4e21), step 1's update
    (its gradients saturated) grew them little, and the failure came at step 2: step 0 is the
    jump, though the step just before the failure was no jump of its own."""
    from nanhunt.analyse.diagnose.curves import _jump
    from nanhunt.trace import Trace

    t = Trace(signals=_signals((2.7, 4.06e21, 4.06e21), (4.06e21, 5e21, 3e21)))
    step, g, ratio, was = _jump(t, 2)
    assert (step, was) == (0, 2.7) and ratio == pytest.approx(1.0)
    # brought back within 10x of the old norm before the failure: not what it computed with
    t = Trace(signals=_signals((2.7, 4e21, 4e21), (4e21, 20.0, 4e21)))
    assert _jump(t, 2) is None
    # a zero-initialised group's first update replaces nothing: its ratio is 1 by definition
    t = Trace(signals=_signals((0.0, 1e-3, 1e-3), (1e-3, 2e-3, 1e-3)))
    assert _jump(t, 2) is None
    # a jump long before the failure (here a group's small initial weights, outgrown by its
    # first update, four healthy steps before it) is not read as its cause
    healthy = [(4e21 * (1 + i / 100), 4e21 * (1 + (i + 1) / 100), 4e18) for i in range(4)]
    t = Trace(signals=_signals((2.7, 4e21, 4e21), *healthy))
    assert _jump(t, 5) is None and _jump(t, 3) is not None
    # healthy updates: none
    t = Trace(signals=_signals((2.7, 2.71, 0.003), (2.71, 2.72, 0.003)))
    assert _jump(t, 2) is None


def test_a_small_initial_group_outgrown_by_a_healthy_first_update_is_no_jump():
    """A LayerScale-style group initialised at 1e-5 (CaiT), in a param group of its own, with
    AdamW at lr 1e-3: its first update replaces its tiny weights (ratio 1, 5.7e-5 -> 5.6e-3),
    as designed. An unrelated input spike at step 2 overflows the LayerNorm: that overflow is
    the diagnosis, not the learning rate (the group's new weights are far below the model's)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.ln, self.b = nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 1)
            self.gamma = nn.Parameter(1e-5 * torch.ones(32))

        def forward(self, x):
            h = self.a(x)
            return self.b(h + self.gamma * nn.functional.gelu(self.ln(h)))

    torch.manual_seed(0)
    m = Net()
    decay = [p for n, p in m.named_parameters() if n != "gamma"]
    opt = torch.optim.AdamW([{"params": decay}, {"params": [m.gamma], "weight_decay": 0.0}],
                            lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with nanhunt.watch(m, opt) as hunt:
        for step in range(4):
            loss = nn.functional.mse_loss(m(x * 1e25 if step == 2 else x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    trace = analyse(hunt.trace(), hunt.snapshot)
    gamma = trace.signals[0].groups[1]
    assert gamma.update_ratio > 0.5 and gamma.weight_norm > 10 * gamma.weight_norm_before
    assert (trace.first_failure.step, trace.first_failure.module) == (2, "ln")
    assert trace.diagnosis.rule != "update-jump" and trace.diagnosis.kind != "lr_too_high"


def test_an_update_that_followed_an_exploded_gradient_is_the_gradients_doing():
    """SGD at lr 0.2 after GradScaler skipped every earlier step: the one applied step's
    gradient (norm 6835) dwarfs the weights (36) and the update (1367) follows it; that is an
    exploding gradient (clipping answers it), not a learning rate that replaced the weights."""
    from nanhunt.analyse.diagnose.curves import _jump
    from nanhunt.trace import GroupSignal, SignalStep, Trace

    g = GroupSignal(group="SGD[0]", weight_norm_before=36.1, weight_norm=1367.6,
                    update_norm=1367.0, grad_norm=6835.2, lr=0.2)
    assert _jump(Trace(signals=[SignalStep(12, [g])]), 13) is None
    g.grad_norm = 3.0  # the same update from an ordinary gradient: the lr made it
    assert _jump(Trace(signals=[SignalStep(12, [g])]), 13) is not None
