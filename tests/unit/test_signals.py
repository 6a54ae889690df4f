"""The per-step signals (nanhunt/capture/signals.py) against references the test computes itself:
copies of the parameters before and after each step, numpy float64 norms, hooks of its own."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x):
        q, k = self.qk(x).split(8, dim=-1)
        return (q @ k.transpose(-2, -1) / math.sqrt(8)).softmax(-1) @ x


def _model():
    torch.manual_seed(0)
    return nn.Sequential(Attn(), nn.Linear(8, 4))


def _train(model, opt, steps, watch=None, reference=None):
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 5, 8).to(next(model.parameters()).dtype)
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, 4).float(), torch.randint(0, 4, (20,))).backward()
        before = [[p.detach().clone() for p in g["params"]] for g in opt.param_groups]
        grads = [[p.grad.detach().clone() for p in g["params"]] for g in opt.param_groups]
        opt.step()
        if reference is not None:
            reference.append((before, grads, [[p.detach().clone() for p in g["params"]]
                                              for g in opt.param_groups], opt))


def _norm(ts):
    return math.sqrt(sum(float((t.double().numpy() ** 2).sum()) for t in ts))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_group_signals_match_copies_made_by_the_test(mode):
    model = _model()
    opt = torch.optim.Adam([{"params": model[0].parameters()},
                            {"params": model[1].parameters(), "lr": 0.1}], lr=1e-2)
    ref: list = []
    session = nanhunt.watch(model, opt) if mode == "full" else \
        nanhunt.sentinel(model, opt, out=None)
    with session as h:
        _train(model, opt, 3, reference=ref)
    t = h.trace()
    assert [g.name for g in t.param_groups] == ["Adam[0]", "Adam[1]"]
    assert t.param_groups[1].modules == ["1"] and t.param_groups[1].elements == 36
    assert [s.step for s in t.signals] == [0, 1, 2]
    for sig, (before, grads, after, o) in zip(t.signals, ref):  # noqa: B007 (o: after the loop)
        for gi, g in enumerate(sig.groups):
            delta = [a - b for a, b in zip(after[gi], before[gi])]
            assert g.weight_norm == pytest.approx(_norm(after[gi]), rel=1e-5)
            assert g.update_norm == pytest.approx(_norm(delta), rel=1e-4)
            assert g.grad_norm == pytest.approx(_norm(grads[gi]), rel=1e-5)
            assert g.update_ratio == pytest.approx(_norm(delta) / _norm(after[gi]), rel=1e-4)
            changed = sum(int((d != 0).sum()) for d in delta)
            assert g.unchanged == pytest.approx(1 - changed / sum(d.numel() for d in delta))
            assert g.lr == [1e-2, 0.1][gi]
    # the second moment of the last step, from the optimizer's own state
    v = [o.state[p]["exp_avg_sq"].double().numpy() for p in o.param_groups[1]["params"]]
    last = t.signals[-1].groups[1]
    assert last.moment2_max == pytest.approx(max(float(x.max()) for x in v), rel=1e-6)
    assert last.moment2_mean == pytest.approx(
        sum(float(x.sum()) for x in v) / sum(x.size for x in v), rel=1e-5)


def test_signals_leave_training_bit_identical():
    runs = []
    for watched in (False, True):
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if watched:
            with nanhunt.watch(model, opt):
                _train(model, opt, 3)
        else:
            _train(model, opt, 3)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_attention_logits_are_the_softmax_input_inside_the_module():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen: dict[int, float] = {}

    def probe(module, args, out):  # the logits recomputed from the projection's output
        q, k = out.detach().split(8, dim=-1)
        logits = q @ k.transpose(-2, -1) / math.sqrt(8)
        seen[len(seen)] = float(logits.abs().max())

    handle = model[0].qk.register_forward_hook(probe)
    with nanhunt.watch(model, opt) as h:
        _train(model, opt, 3)
    handle.remove()
    layer = next(lay for lay in h.trace().layers if lay.module == "0")
    assert layer.logit_amax_by_step == pytest.approx(seen, rel=1e-5)
    assert "softmax" not in vars(torch.Tensor)  # the patch is gone, nothing shadows it


def test_bfloat16_updates_that_round_away_are_counted():
    torch.manual_seed(0)
    w = nn.Parameter(torch.full((1000,), 1.0, dtype=torch.bfloat16))
    opt = torch.optim.SGD([w], lr=1.0)
    with nanhunt.watch(None, opt) as h:
        for _ in range(2):
            opt.zero_grad()
            # gradients of 1e-3 and 1e-1: the first round away at 1.0 (ulp 2^-7), the second not
            w.grad = torch.where(torch.arange(1000) < 900, 1e-3, 1e-1).to(torch.bfloat16)
            opt.step()
    g = h.trace().signals[-1].groups[0]
    assert g.unchanged == pytest.approx(0.9)
    assert np.isfinite(g.update_norm)
