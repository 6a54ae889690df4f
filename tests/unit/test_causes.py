"""The rules of nanhunt.causes on hand-built traces, and their arithmetic against torch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanhunt.analyse.advise import advise
from nanhunt.analyse.diagnose import diagnose
from nanhunt.analyse.diagnose.causes import (
    RangeConstant,
    find_constants,
    finfo_fix,
    rounded,
    scaler_error,
)
from nanhunt.formats import get_format
from nanhunt.trace import (
    Crash,
    Failure,
    InputRange,
    LayerStats,
    OpRecord,
    OptimizerInfo,
    RunInfo,
    StepRecord,
    TensorStats,
    Trace,
)

FP16 = get_format("float16")


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=-7e4, max_value=7e4, allow_nan=False))
def test_rounded_matches_torch_float16(x):
    expected = torch.tensor(x, dtype=torch.float64).to(torch.float16).double().item()
    assert rounded(x, FP16) == expected or (math.isinf(expected) and math.isinf(rounded(x, FP16)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("eps", [1e-12, 1e-8, 3e-8, 6e-8, 1e-7, 1e-6, 1e-5, 1e-4])
def test_rounded_eps_matches_torch(dtype, eps):
    expected = torch.tensor(eps, dtype=getattr(torch, dtype)).double().item()
    assert rounded(eps, get_format(dtype)) == expected


def test_find_constants_and_finfo_fix():
    line = "scores = scores.masked_fill(pad[:, None, :], -1e9)"
    (c,) = find_constants(line, FP16)
    assert (c.value, c.text) == (-1e9, "-1e9")
    assert finfo_fix(line, c, FP16) == \
        "scores = scores.masked_fill(pad[:, None, :], torch.finfo(scores.dtype).min)"
    line = "filler = torch.full((n, pad), 1e5, dtype=dist.dtype)"
    (c,) = find_constants(line, FP16)
    assert finfo_fix(line, c, FP16) == \
        "filler = torch.full((n, pad), torch.finfo(dist.dtype).max, dtype=dist.dtype)"
    # values float16 holds are not reported; float('-1e9') is
    assert find_constants("x.masked_fill(m, -1e4)", FP16) == []
    assert find_constants("x.masked_fill(m, float('-1e9'))", FP16)[0].value == -1e9
    assert finfo_fix("y = x + 1e6", RangeConstant(1e6, "1e6"), FP16) == \
        "y = x + torch.finfo(torch.float16).max"


def test_scaler_error_messages_are_torchs_own():
    # the messages GradScaler raises, produced by torch here, not copied
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError) as twice:
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError) as again:
        scaler.step(opt)
    assert scaler_error(str(twice.value))[0] == "unscale_twice"
    assert scaler_error(str(again.value))[0] == "step_without_update"
    assert scaler_error("some other error") is None


def _crash_trace(crash: Crash) -> Trace:
    return Trace(run=RunInfo(status="crashed", error=f"{crash.type}: {crash.message}"),
                 crash=crash)


def test_range_constant_rule_names_the_line_and_constant():
    t = _crash_trace(Crash(
        "RuntimeError", "value cannot be converted to type c10::Half without overflow",
        source="/x/model.py:31", source_line="scores = scores.masked_fill(mask, -1e9)",
        module="attn", step=0))
    diagnose(t)
    advise(t)
    d = t.diagnosis
    assert (d.rule, d.kind, d.phase, d.module, d.step) == ("range-constant", "overflow",
                                                           "forward", "attn", 0)
    assert "-1e9" in d.message and "model.py:31" in d.message
    rec = t.recommendations[0]
    assert rec.type == "finfo_constant"
    assert "scores.masked_fill(mask, torch.finfo(scores.dtype).min)" in rec.snippet
    compile(rec.snippet, "snippet", "exec")


def test_range_constant_held_in_a_variable():
    t = _crash_trace(Crash(
        "RuntimeError", "value cannot be converted to type c10::Half without overflow",
        source="/x/model.py:40", source_line="f = torch.full(shape, big, dtype=d.dtype)",
        module="knn", values={"big": 1e5, "shape": 3.0}))
    diagnose(t)
    advise(t)
    assert t.diagnosis.data["constant"] == 1e5
    assert "big = torch.finfo(d.dtype).max" in t.recommendations[0].snippet


def test_scaler_crash_rule():
    t = _crash_trace(Crash("RuntimeError", "step() has already been called since the last "
                           "update().", source="/x/train.py:50",
                           source_line="scaler.step(optimizer)", step=1))
    diagnose(t)
    advise(t)
    d = t.diagnosis
    assert (d.rule, d.kind, d.phase, d.step) == ("scaler-crash", "loss_scale", "loss_scaling", 1)
    assert "scaler.update()" in d.message and "train.py:50" in d.message
    assert t.recommendations[0].type == "scaler_usage"


def _stats(dtype="float16", nan=0, posinf=0, amax=1.0, numel=64) -> TensorStats:
    return TensorStats(dtype=dtype, shape=[numel], numel=numel, nan=nan, posinf=posinf,
                       amax=amax)


def test_norm_eps_from_the_replayed_ops():
    ops = [
        OpRecord(0, "aten.pow.Tensor_Scalar", "forward", "float16", 9.0, 0, 64, scalars=[2.0]),
        OpRecord(1, "aten.mean.dim", "forward", "float16", 2.0, 0, 8),
        OpRecord(2, "aten.add.Tensor", "forward", "float16", 2.0, 0, 8, source="n.py:9",
                 scalars=[1e-12], zeros=2),
        OpRecord(3, "aten.rsqrt.default", "forward", "float16", 3.0, 2, 8,
                 first_nonfinite=True),
    ]
    t = Trace(
        run=RunInfo(dtypes=["float16"]),
        layers=[LayerStats("norm", "RMSNorm", forward_amax_by_step={0: 3.0})],
        steps=[StepRecord(0)],
        first_failure=Failure(0, "forward", "norm", "output", _stats(nan=16),
                              op="aten.rsqrt"),
        ops=ops,
    )
    diagnose(t)
    d = t.diagnosis
    assert (d.rule, d.kind) == ("norm-eps", "underflow")
    assert d.data["eps"] == 1e-12 and d.data["becomes"] == 0.0
    # a subnormal but nonzero eps (1e-6 in float16) is not this rule's case
    ops[2].scalars = [1e-6]
    t.diagnosis, t.warnings = None, []
    diagnose(t)
    assert t.diagnosis.rule != "norm-eps"


def _input_trace(amax: float, weights: float = 0.5) -> Trace:
    return Trace(
        run=RunInfo(dtypes=["float16"], autocast=True),
        layers=[LayerStats("", "Net", params=0), LayerStats("stem", "Conv2d", params=400,
                                                             param_amax_by_step={}),
                LayerStats("head", "Linear", params=40)],
        steps=[StepRecord(0)],
        first_failure=Failure(0, "forward", "stem", "output", _stats(posinf=10, amax=6e4),
                              op="aten.convolution",
                              inputs=[InputRange("input[0]", "float32", [4, 1, 8, 8], 0.0,
                                                 amax, amax, amax / 2, amax / 4)]),
    )


def test_input_range_only_for_raw_inputs_of_the_first_layer():
    t = _input_trace(4095.0)
    diagnose(t)
    advise(t)
    d = t.diagnosis
    assert (d.rule, d.kind, d.phase, d.module) == ("input-range", "bad_input", "data", "stem")
    rec = t.recommendations[0]
    assert rec.type == "normalize_input" and "/ 4095.0" in rec.snippet
    # a normalised input: the overflow is the layer's own
    t = _input_trace(3.0)
    diagnose(t)
    assert t.diagnosis.rule == "forward-overflow"
    # not the first layer with weights: not the input's fault
    t = _input_trace(4095.0)
    t.first_failure.module = "head"
    diagnose(t)
    assert t.diagnosis.rule != "input-range"


def test_optimizer_eps_from_the_optimizer_and_lr_only_with_growth():
    def trace(params: dict[int, float], eps: float) -> Trace:
        return Trace(
            run=RunInfo(dtypes=["float16"]),
            layers=[LayerStats("fc", "Linear", params=64, param_amax_by_step=params,
                               param_grad=_stats(amax=0.01))],
            steps=[StepRecord(i) for i in range(len(params))],
            first_failure=Failure(max(params), "optimizer", "fc", "fc.weight",
                                  _stats(posinf=5, amax=0.5)),
            optimizers=[OptimizerInfo("Adam", lr=1e-3, eps=eps, param_dtypes=["float16"],
                                      params=2)],
        )

    t = trace({0: 0.5}, 1e-8)
    diagnose(t)
    assert (t.diagnosis.rule, t.diagnosis.kind) == ("optimizer-eps", "underflow")
    assert "Adam's eps=1e-08" in t.diagnosis.message
    # weights that grew over several steps: the learning rate, whatever the eps
    t = trace({0: 1.0, 1: 4.0, 2: 16.0, 3: 64.0}, 1e-4)
    diagnose(t)
    assert t.diagnosis.kind == "lr_too_high"


def test_an_input_beyond_the_format_is_raw_input_whatever_the_op_makes():
    # 65535 > float16's max: the cast makes inf and the conv turns inf - inf into NaN, which
    # alone would read as an invalid op of the model's
    t = _input_trace(65535.0)
    t.first_failure.stats = _stats(nan=40, posinf=2, amax=6.5e4)
    t.first_failure.op = "aten._to_copy"
    diagnose(t)
    d = t.diagnosis
    assert (d.rule, d.kind, d.phase) == ("input-range", "bad_input", "data")
    assert any("exceeds float16's max" in e for e in d.evidence)
    assert "forward-nan-op" not in [w.rule for w in t.warnings]  # explained by the input


def _constant_trace(value: float, op: str = "aten.scalar_tensor.default") -> Trace:
    line = f"e = torch.where(adj > 0, e, {value:g})"
    return Trace(
        run=RunInfo(dtypes=["float16"], autocast=True),
        layers=[LayerStats("gat1", "GATLayer", params=64, forward_amax_by_step={0: 2.0})],
        steps=[StepRecord(0)],
        first_failure=Failure(0, "forward", "gat1", "output", _stats(nan=32, amax=2.0)),
        ops=[OpRecord(0, "aten.mm.default", "forward", "float16", 2.5, 0, 64),
             OpRecord(1, op, "forward", "float16", 0.0, 1 if abs(value) > 65504 else 0, 1,
                      source=f"g.py:28  {line}", first_nonfinite=abs(value) > 65504,
                      scalars=[value])],
    )


def test_a_constant_torch_turns_into_inf_without_an_error():
    t = _constant_trace(-1e5)
    diagnose(t)
    advise(t)
    d = t.diagnosis
    assert (d.rule, d.kind, d.phase, d.module) == ("range-constant", "overflow", "forward",
                                                   "gat1")
    assert d.data["constant"] == -1e5 and d.data["source"] == "g.py:28"
    # 1e5 / 65504 is 2**0.61: the binades beyond float16's max, by hand
    assert "0.6 binades beyond it" in " ".join(d.evidence)
    rec = t.recommendations[0]
    assert rec.type == "finfo_constant" and "torch.finfo(" in rec.snippet
    assert "forward-nan-op" not in [w.rule for w in t.warnings]
    # a constant float16 holds is not the cause (the op that then went non-finite is)
    t = _constant_trace(-1e4)
    t.ops[1].first_nonfinite = False
    diagnose(t)
    assert t.diagnosis is None or t.diagnosis.rule != "range-constant"
    # nor is a big number handed to an op that does not write it (a matmul's alpha)
    t = _constant_trace(-1e5, op="aten.addmm.default")
    diagnose(t)
    assert t.diagnosis.rule != "range-constant"
