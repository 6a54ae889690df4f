"""The precision audit: SQNR against numpy, ranking rules, the library form."""

from __future__ import annotations

import copy
import doctest
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import nanhunt
import nanhunt.precision
from nanhunt.analyse import rank
from nanhunt.formats import get_format
from nanhunt.precision._observe import energies
from nanhunt.trace import PrecisionAudit, PrecisionLayer, Trace

floats = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(floats, floats), min_size=1, max_size=64))
def test_sqnr_matches_numpy_float64(pairs):
    ref = np.array([p[0] for p in pairs], dtype=np.float64)
    approx = np.array([p[1] for p in pairs], dtype=np.float64)
    sig, noise, bad = energies(torch.tensor(ref, dtype=torch.float32),
                               torch.tensor(approx, dtype=torch.float32))
    ref32, app32 = ref.astype(np.float32).astype(np.float64), approx.astype(np.float32)
    want_sig = float(np.sum(ref32**2))
    want_noise = float(np.sum((app32.astype(np.float64) - ref32) ** 2))
    assert bad == 0
    assert sig == pytest.approx(want_sig, rel=1e-12, abs=1e-300)
    assert noise == pytest.approx(want_noise, rel=1e-12, abs=1e-300)
    got = rank.sqnr_db(sig, noise)
    if want_noise == 0:
        assert got == (math.inf if want_sig > 0 else None)
    elif want_sig == 0:
        assert got == -math.inf
    else:
        assert got == pytest.approx(10 * np.log10(want_sig / want_noise), abs=1e-9)


def test_nominal_sqnr_is_uniform_rounding_noise():
    # rounding N(0,1) samples to float16 gives close to the nominal SQNR (numpy reference)
    x = np.random.default_rng(0).standard_normal(200_000)
    r = x.astype(np.float16).astype(np.float64)
    measured = 10 * np.log10(np.sum(x**2) / np.sum((r - x) ** 2))
    assert measured == pytest.approx(rank.nominal_sqnr_db(get_format("float16")), abs=1.5)


def _layers(*spec):
    return [PrecisionLayer(m, t, sqnr_db=s, parent=p, leaf=leaf, depth=d, order=i)
            for i, (m, t, s, p, leaf, d) in enumerate(spec)]


def test_a_layer_far_below_the_rest_stands_out_and_its_container_is_explained():
    a = PrecisionAudit("float16", layers=_layers(
        ("model", "Net", 9.0, None, False, 0), ("fc", "Linear", 66.0, "model", True, 1),
        ("shift", "Shift", 10.0, "model", True, 1), ("head", "Linear", 64.0, "model", True, 1)))
    rank.rank_layers(a, get_format("float16"))
    by = {x.module: x for x in a.layers}
    assert by["shift"].rank == 1 and by["shift"].stands_out
    assert by["model"].rank is None and by["model"].explained_by == "shift"
    assert not by["fc"].stands_out and not by["head"].stands_out
    assert rank.fp32_groups(a) == [("shift", ["shift"])]


def test_no_layer_stands_out_when_all_lose_alike():
    a = PrecisionAudit("bfloat16", layers=_layers(
        ("a", "Linear", 50.0, None, True, 0), ("b", "Linear", 47.0, None, True, 0),
        ("c", "GELU", math.inf, None, True, 0), ("d", "Linear", 52.0, None, True, 0)))
    rank.rank_layers(a, get_format("bfloat16"))
    assert not any(x.stands_out for x in a.layers)
    assert rank.fp32_groups(a) == []
    assert rank.recommend(a, lambda mods: (1.0, 0.0)) is None


def test_siblings_become_a_pattern_only_when_all_stand_out():
    spec = [(f"blocks.{i}.rope", "Rotary", 12.0, None, True, 1) for i in range(3)]
    spec += [(f"blocks.{i}.fc", "Linear", 66.0, None, True, 1) for i in range(3)]
    a = PrecisionAudit("float16", layers=_layers(*spec))
    rank.rank_layers(a, get_format("float16"))
    assert rank.fp32_groups(a) == [("blocks.*.rope", [f"blocks.{i}.rope" for i in range(3)])]
    a.layers[2].sqnr_db = 66.0  # one sibling is fine: name the two instances
    rank.rank_layers(a, get_format("float16"))
    assert rank.fp32_groups(a) == [("blocks.0.rope", ["blocks.0.rope"]),
                                   ("blocks.1.rope", ["blocks.1.rope"])]


def test_recommendation_is_verified_only_when_the_loss_error_halves():
    a = PrecisionAudit("float16", steps=2, layers=_layers(
        ("fc", "Linear", 66.0, None, True, 0), ("shift", "Shift", 10.0, None, True, 0),
        ("head", "Linear", 64.0, None, True, 0)))
    rank.rank_layers(a, get_format("float16"))
    good = rank.recommend(a, lambda mods: (1e-3, 1e-6))
    bad = rank.recommend(a, lambda mods: (1e-3, 8e-4))
    assert good.verified and "1e-06" in good.verification and good.data["modules"] == ["shift"]
    assert not bad.verified and bad.verification.startswith("did not help")
    assert 'run_in_float32(model, "shift")' in good.snippet


def test_module_docstring_example_runs():
    assert doctest.testmod(nanhunt.precision, optionflags=doctest.ELLIPSIS).failed == 0
    assert doctest.testmod(rank).failed == 0


class Shift(nn.Module):
    def forward(self, x):
        return (x + 1024.0) - 1024.0


def _model(shift: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.GELU()] + ([Shift()] if shift else []) + [nn.Linear(16, 3)]
    return nn.Sequential(*layers).half()


def _batches():
    g = torch.Generator().manual_seed(1)
    return lambda: (torch.randn(32, 8, generator=g).half(), torch.randint(0, 3, (32,),
                                                                          generator=g))


def _loss(out, y):
    return nn.functional.cross_entropy(out.float(), y)


def test_library_ranks_the_cancellation_first_and_leaves_the_model_alone():
    model = _model(shift=True)
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    trace = nanhunt.audit(model, _batches(), _loss, steps=2)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    pr = trace.precision
    assert pr.target == "float16" and pr.mode == "measured" and pr.reproduced
    first, second = sorted((x for x in pr.layers if x.rank), key=lambda x: x.rank)[:2]
    assert first.module == "2" and first.stands_out
    assert second.sqnr_db - first.sqnr_db > 30
    [rec] = trace.recommendations
    assert rec.type == "fp32_module" and rec.data["modules"] == ["2"] and rec.verified
    loaded = Trace.from_json(trace.to_json()).precision
    assert {x.module: x.rank for x in loaded.layers}["2"] == 1


def test_library_sqnr_of_the_layer_matches_a_numpy_reference():
    model = _model(shift=True)
    x, y = _batches()()
    seen = {}
    h = model[2].register_forward_hook(lambda m, a, o: seen.update(inp=a[0], out=o))
    model(x)
    h.remove()
    # the float32 replay runs on float32 copies of the same (float16) input
    ref = seen["inp"].detach().double().numpy()
    ref = (ref.astype(np.float32) + np.float32(1024.0)) - np.float32(1024.0)
    got = seen["out"].detach().double().numpy()
    want = 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / np.sum((got - ref) ** 2))
    trace = nanhunt.audit(model, lambda: (x, y), _loss, steps=1)
    layer = next(x for x in trace.precision.layers if x.module == "2")
    assert layer.sqnr_db == pytest.approx(want, abs=1e-6)


def test_library_clean_model_gets_no_advice_and_fp32_targets_are_simulated():
    model = _model(shift=False).float()
    trace = nanhunt.audit(model, lambda: (torch.randn(32, 8), torch.randint(0, 3, (32,))),
                          _loss, target="float16,bfloat16", steps=2)
    pr = trace.precision
    assert [pr.target] + [o.target for o in pr.compare] == ["float16", "bfloat16"]
    assert pr.mode == "simulated" and "autocast" in pr.simulation
    assert not trace.recommendations and not any(x.stands_out for x in pr.layers)
    # bfloat16 keeps fewer mantissa bits: every Linear loses more than in float16
    f16 = {x.module: x.sqnr_db for x in pr.layers if x.type == "Linear"}
    b16 = {x.module: x.sqnr_db for x in pr.compare[0].layers if x.type == "Linear"}
    assert all(b16[m] < f16[m] - 10 for m in f16)


def test_fp8_target_rounds_the_gemms():
    model = _model(shift=False).float()
    trace = nanhunt.audit(model, lambda: (torch.randn(32, 8), torch.randint(0, 3, (32,))),
                          _loss, target="float8_e4m3fn", steps=1)
    lin = [x for x in trace.precision.layers if x.type == "Linear"]
    nominal = rank.nominal_sqnr_db(get_format("float8_e4m3fn"))
    assert all(x.sqnr_db < nominal + 6 for x in lin)  # about 3 mantissa bits, not float32


def test_bad_target_is_one_clear_error():
    with pytest.raises(nanhunt.NanhuntError, match="unknown target format"):
        nanhunt.audit(_model(True), _batches(), _loss, target="float64")
    with pytest.raises(nanhunt.NanhuntError, match="against float32"):
        nanhunt.audit(_model(True), _batches(), _loss, target="float32")


def test_a_failing_audit_leaves_a_note_and_the_run_alone(monkeypatch):
    from nanhunt.precision import _audit

    def boom(self, *a, **k):
        raise RuntimeError("planted")

    monkeypatch.setattr(_audit.Auditor, "_replay", boom)
    model = _model(shift=True)
    trace = nanhunt.audit(model, _batches(), _loss, steps=2)
    assert trace.precision is None
    assert any("planted" in n for n in trace.notes)


EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> dict:
    import runpy

    return runpy.run_path(str(EXAMPLES / "audit" / name), run_name="example")


@pytest.mark.parametrize(("script", "build", "batch", "culprit"), [
    ("shift_cnn.py", lambda ns: ns["CNN"](),
     lambda: (torch.randn(16, 3, 8, 8) * 3, torch.randint(0, 3, (16,))), "features.2"),
    ("accumulate_transformer.py", lambda ns: ns["Net"](),
     lambda: (torch.randint(0, 32, (2, 512)), None), "block.mixer"),
])
def test_siblings_in_other_architectures(script, build, batch, culprit):
    """The CNN and transformer siblings of the CLI's MLP scripts, through the library: an fp32
    model audited against float16 (autocast simulated, as the scripts run it)."""
    ns = _example(script)
    torch.manual_seed(0)
    model = build(ns)

    def loss_fn(out, y):
        if y is None:  # next-token loss on the same ids
            return nn.functional.cross_entropy(out[:, :-1].float().reshape(-1, out.shape[-1]),
                                               fixed_ids[:, 1:].reshape(-1))
        return nn.functional.cross_entropy(out.float(), y)

    fixed_ids = torch.randint(0, 32, (2, 512))
    batches = (lambda: (fixed_ids, None)) if y_is_none(batch) else batch
    trace = nanhunt.audit(model, batches, loss_fn, steps=2)
    ranked = sorted((x for x in trace.precision.layers if x.rank), key=lambda x: x.rank)
    assert ranked[0].module == culprit and ranked[0].stands_out
    assert ranked[1].sqnr_db - ranked[0].sqnr_db >= 20
    [rec] = trace.recommendations
    assert rec.data["modules"] == [culprit] and rec.verified, rec.verification


def y_is_none(batch) -> bool:
    return batch()[1] is None


def test_clean_cnn_with_batchnorm_gets_no_advice_and_keeps_its_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    stats = copy.deepcopy(model[1].state_dict())
    trace = nanhunt.audit(model, lambda: (torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))),
                          _loss, target="bfloat16", steps=2)
    assert not trace.recommendations
    assert not any(x.stands_out for x in trace.precision.layers)
    assert all(torch.equal(v, model[1].state_dict()[k]) for k, v in stats.items())


class _Masked(nn.Module):
    """Causal attention scores with a -inf mask added (healthy_gpt.py's pattern)."""

    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)
        return ((q @ k.transpose(1, 2)) / 2.0 + mask).softmax(-1) @ x


def test_masked_attention_is_measured_without_a_note():
    model = nn.Sequential(_Masked(), nn.Flatten(), nn.Linear(40, 3))
    trace = nanhunt.audit(model, lambda: (torch.randn(4, 5, 8), torch.randint(0, 3, (4,))),
                          _loss, steps=1)
    assert trace.notes == [] and trace.precision is not None
    att = next(x for x in trace.precision.layers if x.type == "_Masked")
    assert "ops_unmeasured" not in att.data and math.isfinite(att.sqnr_db)
