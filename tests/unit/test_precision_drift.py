"""The drift jump (``drift_jump_db``, ``drift_added_db``, ``sqnr_db_end_to_end_in``) against a
numpy float64 computation of the same model on the same batch, and its part in the ranking."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import nanhunt
from nanhunt.analyse import rank
from nanhunt.formats import get_format
from nanhunt.trace import PrecisionAudit, PrecisionLayer


class Shift(nn.Module):
    def forward(self, x):
        return (x + 1024.0) - 1024.0


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    return 10 * np.log10(np.sum(ref**2) / np.sum((got - ref) ** 2))


def _rel(ref: np.ndarray, got: np.ndarray) -> float:
    return float(np.sum((got - ref) ** 2) / np.sum(ref**2))


def test_drift_fields_match_a_numpy_float64_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Shift(), nn.Linear(16, 3)).half()
    x, y = torch.randn(64, 8).half(), torch.randint(0, 3, (64,))
    seen = {}
    hooks = [m.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o))
             for i, m in enumerate(model)]
    model(x)
    for h in hooks:
        h.remove()
    run = {i: t.detach().double().numpy() for i, t in seen.items()}  # what float16 computed
    # the whole model in float64 from the same (float16) weights and batch
    w1, b1, w2, b2 = (p.detach().double().numpy() for p in model.parameters())
    h1 = x.double().numpy() @ w1.T + b1
    h2 = h1.copy()  # (h + c) - c is exact in float64
    out = h2 @ w2.T + b2
    ref = {0: h1, 1: h2, 2: out}
    trace = nanhunt.audit(model, lambda: (x, y),
                          lambda o, t: nn.functional.cross_entropy(o.float(), t), steps=1)
    by = {layer.module: layer for layer in trace.precision.layers}
    # float32 against float64 differs by ~1e-7 relative: far below float16's error
    for i, name in enumerate(("0", "1", "2")):
        layer = by[name]
        assert layer.sqnr_db_end_to_end == pytest.approx(_sqnr(ref[i], run[i]), abs=0.05)
        if i == 0:  # its input is the batch, exact on both sides: the drift starts here
            assert layer.sqnr_db_end_to_end_in == math.inf and layer.drift_jump_db == math.inf
            continue
        want_in = _sqnr(ref[i - 1], run[i - 1])
        assert layer.sqnr_db_end_to_end_in == pytest.approx(want_in, abs=0.05)
        assert layer.drift_jump_db == pytest.approx(want_in - _sqnr(ref[i], run[i]), abs=0.1)
        added = _rel(ref[i], run[i]) - _rel(ref[i - 1], run[i - 1])
        if added > 0:
            assert layer.drift_added_db == pytest.approx(-10 * np.log10(added), abs=0.1)
        else:
            assert layer.drift_added_db == math.inf
    # the cancellation is where the drift jumps: tens of dB, far more than the last Linear
    assert by["1"].drift_jump_db > 30 and by["1"].drift_jump_db > by["2"].drift_jump_db + 20
    assert [x.module for x in trace.precision.layers if x.rank == 1] == ["1"]


def test_a_big_jump_ranks_a_layer_by_the_drift_it_adds_a_small_one_does_not():
    def layer(name, own, jump, added, order):
        return PrecisionLayer(name, "Linear", sqnr_db=own, drift_jump_db=jump,
                              drift_added_db=added, order=order)

    a = PrecisionAudit("float16", layers=[
        layer("a", 70.0, math.inf, 70.0, 0),
        layer("amplifier", 68.0, 35.0, 30.0, 1),  # fine alone, but the drift jumps 35 dB
        layer("after", 69.0, 6.0, 25.0, 2),  # a few dB more drift than it got: own SQNR
        layer("b", 66.0, 0.5, math.inf, 3)])
    rank.rank_layers(a, get_format("float16"))
    order = sorted(a.layers, key=lambda x: x.rank)
    assert [x.module for x in order] == ["amplifier", "b", "after", "a"]
    # standing out (and the fp32 advice) stays on the own SQNR: float32 for a layer removes
    # its own rounding, not the drift it amplifies
    assert not any(x.stands_out for x in a.layers)
