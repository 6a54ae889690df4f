"""A failure whose origin nanhunt did not observe gets no confident cause (issue 21, item 3).

The script trains with a hand-written SGD (``p.data.add_(...)``, as pytorch/
examples' word_language_model does): no torch optimizer, so no hook sees the update. At step
``BAD`` a bug in it writes inf into the LayerNorm's weight; the next forward reads it and
the loss goes NaN. The reference is the script itself: the weights
were finite after step ``BAD - 1`` and non-finite after step ``BAD``'s update, before any
module ran again (checked below by hand). Every mode must say that the origin was not observed
instead of naming the LayerNorm's forward as an overflow or invalid op.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt.pipeline import analyse

BAD, STEPS = 6, 9


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 16)

    def forward(self, ids):
        return self.out(self.norm(self.emb(ids)))


def train(session=None, finite_after=None):
    torch.manual_seed(0)
    model = TinyLM()
    g = torch.Generator().manual_seed(1)
    s = session(model) if session else None
    ctx = s if s is not None else _Null()
    with ctx:
        for step in range(STEPS):
            ids = torch.randint(0, 16, (4, 5), generator=g)
            model.zero_grad()
            loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)
                if step == BAD and p is model.norm.weight:  # a bug in the hand-written step
                    p.data.mul_(1e20).mul_(1e20)  # overflows float32
            if finite_after is not None:
                finite_after.append(all(bool(torch.isfinite(p).all())
                                        for p in model.parameters()))
    return s


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_reference_the_update_of_step_bad_makes_the_weights_non_finite():
    finite = []
    train(finite_after=finite)
    assert finite[:BAD] == [True] * BAD and finite[BAD] is False


@pytest.mark.parametrize("mode", ["full", "sampled", "sentinel"])
def test_no_cause_is_named_for_weights_made_non_finite_unobserved(mode):
    session = {"full": lambda m: nanhunt.Hunt(m),
               "sampled": lambda m: nanhunt.Hunt(m, sample_every=4),
               "sentinel": lambda m: nanhunt.sentinel(m, out=None)}[mode]
    s = train(session)
    f = s.first_failure
    assert f is not None and f.step > BAD  # where the symptom surfaced, after the bad update
    if mode == "sampled":
        # step BAD + 1 was not traced (steps 0, 4, 8 are) and the script's update after it
        # changed the weights: it is reported there, as untraced, with no cause
        assert f.step == BAD + 1
        d = analyse(s.trace(), s.snapshot).diagnosis
        assert d.rule == "untraced-step" and d.kind == "" and "not traced" in d.message
        return
    # (full tracing sees the next forward read the inf weight; the sentinel may see a later
    # step, after the NaN gradients it made were applied to every weight)
    assert (f.module, f.step) == ("norm", BAD + 1) or mode != "full"
    assert f.observed is False and "already non-finite" in f.detail
    assert f"{f.module}.weight" in f.detail
    trace = analyse(s.trace(), s.snapshot)
    d = trace.diagnosis
    assert d is not None and d.rule == "untraced-step" and d.kind == ""
    assert "no cause is named" in d.message and f"{f.module}.weight" in d.message


# A failure made inside a step of such a loop, from finite weights: the script's own update,
# after the step's backward, then writes NaN into every weight it touches. The step is judged
# on the weights it read (its transfer goes as its backward returns, before that update), so
# the origin is observed and named.

SPIKE = 3


def train_spike(session=None, finite_before=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    s = session(model) if session else None
    with s if s is not None else _Null():
        for step in range(STEPS):
            if finite_before is not None:
                finite_before.append(all(bool(torch.isfinite(p).all())
                                         for p in model.parameters()))
            batch = x * 1e25 if step == SPIKE else x  # LayerNorm's variance overflows
            model.zero_grad()
            nn.functional.mse_loss(model(batch), y).backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)
    return s


def test_the_reference_weights_were_finite_when_the_spike_step_ran():
    finite = []
    train_spike(finite_before=finite)
    assert finite[:SPIKE + 1] == [True] * (SPIKE + 1) and finite[SPIKE + 1] is False


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_step_is_judged_on_the_weights_it_read_not_those_the_script_wrote_after(mode):
    session = {"full": lambda m: nanhunt.Hunt(m),
               "sentinel": lambda m: nanhunt.sentinel(m, out=None)}[mode]
    s = train_spike(session)
    f = s.first_failure
    assert (f.step, f.phase, f.module) == (SPIKE, "forward", "1")
    assert f.observed is not False, f.detail
    d = analyse(s.trace(), s.snapshot).diagnosis
    assert d is not None and d.kind == "overflow" and d.rule != "untraced-step"


def test_an_untraced_failing_step_of_such_a_loop_is_reported_at_its_own_step():
    """--sample-every: the spike step is not traced. Its weights changed after it (the script's
    own update, as after an optimizer step), so the failure is reported there, with no cause,
    rather than traced at the next step, whose forward reads the weights that update wrote."""
    s = train_spike(lambda m: nanhunt.Hunt(m, sample_every=4))  # traces steps 0, 4, 8
    assert s.first_failure.step == SPIKE
    d = analyse(s.trace(), s.snapshot).diagnosis
    assert d.rule == "untraced-step" and d.kind == "" and "not traced" in d.message
