"""Rules for failures outside the forward pass, on hand-built traces: where gradients first
flush (cast counts), which module's gradients grow, untraced steps, and honest counts in the
report text. Expected numbers are computed here by hand, never copied from nanhunt's output."""

from __future__ import annotations

import math

from nanhunt.analyse.diagnose import diagnose
from nanhunt.formats import get_format
from nanhunt.report._common import shape_text, values_summary, verdict
from nanhunt.trace import (
    CastCounts,
    Failure,
    LayerStats,
    OpRecord,
    OptimizerInfo,
    RunInfo,
    StepRecord,
    TensorStats,
    Trace,
)

FP16 = get_format("float16")


def ts(numel: int, *, zero: int = 0, underflow: int = 0, flushed: int = 0, nan: int = 0,
       amax: float = 1e-6, dtype: str = "float16") -> TensorStats:
    return TensorStats(dtype=dtype, shape=[numel], numel=numel, zero=zero, underflow=underflow,
                       flushed=flushed, nan=nan, amax=amax)


def underflow_trace(cast: CastCounts | None) -> Trace:
    # body -> head, no scaler; the head's output gradient (fp16) is mostly zero and subnormal
    head_bwd = ts(1000, zero=400, underflow=600, amax=2.0**-20)
    body_bwd = ts(4000, zero=4000, amax=0.0)
    layers = [
        LayerStats("body", "Linear", calls=2, dtypes=["float16"], forward=ts(4000, amax=1.0),
                   backward=body_bwd),
        LayerStats("head", "Linear", calls=2, dtypes=["float16"], forward=ts(1000, amax=1e-5),
                   backward=head_bwd, grad_cast=cast),
    ]
    steps = [StepRecord(index=i, loss=1e-9, grad_norm=1e-7) for i in range(2)]
    return Trace(run=RunInfo(target="float16", dtypes=["float16", "float32"], autocast=True),
                 steps=steps, layers=layers, grad_hist={"float16": {-20: 100, -23: 500}})


def test_underflow_names_the_first_module_in_backward_order_from_the_cast():
    cast = CastCounts(values=1000, source_zero=100, flushed=300, subnormal=600,
                      source_dtype="float32", dtype="float16", source_amax=2.0**-20)
    t = underflow_trace(cast)
    diagnose(t, strict=True)
    w = next(f for f in [t.diagnosis, *t.warnings] if f and f.rule == "gradient-underflow")
    assert (w.module, w.phase, w.kind) == ("head", "backward", "underflow")
    site = w.data["site"]
    # the 100 zeros before the cast are not flushed: 300 of the 900 non-zero ones are
    assert site["flushed_fraction"] == 300 / 900
    assert site["source_zero"] == 100
    assert "already 0 before the cast" in w.evidence[0]


def test_without_a_cast_the_exact_zeros_are_reported_as_such():
    t = underflow_trace(None)
    diagnose(t, strict=True)
    w = next(f for f in [t.diagnosis, *t.warnings] if f and f.rule == "gradient-underflow")
    assert w.module == "head"  # body comes later in backward
    assert w.data["site"]["source_zero"] is None
    assert "400 of 1,000 values (40%) exactly 0" in w.evidence[0]


def growth_trace(names_calls: dict[str, int], pgrad: dict[str, list[float]]) -> Trace:
    layers = [LayerStats(n, "Linear", calls=c, dtypes=["float32"],
                         param_grad_amax_by_step=dict(enumerate(pgrad.get(n, []))))
              for n, c in names_calls.items()]
    norms = [1.0, 3.0, 20.0, 150.0, 900.0]
    steps = [StepRecord(index=i, loss=1.0, grad_norm=v) for i, v in enumerate(norms)]
    return Trace(run=RunInfo(target="float16", dtypes=["float32"]), steps=steps, layers=layers)


def test_exploding_gradient_without_failure_is_an_error_naming_the_growing_module():
    t = growth_trace(
        {"cell.gates": 50, "cell": 100, "head": 1, "model": 1},
        {"cell.gates": [1.0, 4.0, 30.0, 200.0, 1000.0], "head": [2.0, 2.5, 3.0, 2.0, 2.2]},
    )
    diagnose(t, strict=True)
    d = t.diagnosis
    # 900 / 1 = 900x >= 100x: a problem although nothing went non-finite
    assert (d.rule, d.severity, d.kind, d.phase) == (
        "exploding-gradient", "error", "exploding_gradient", "backward")
    assert d.module == "cell"  # the outermost module called as often as cell.gates


def test_a_tenfold_growth_alone_stays_a_warning():
    t = growth_trace({"fc": 1}, {"fc": [1.0, 2.0, 4.0, 8.0, 12.0]})
    for s, v in zip(t.steps, [1.0, 2.0, 4.0, 8.0, 12.0]):
        s.grad_norm = v
    diagnose(t, strict=True)
    assert t.diagnosis is None
    assert [w.rule for w in t.warnings] == ["exploding-gradient"]


def test_growth_is_named_where_it_starts_nearest_the_loss():
    # embed <- rnn <- proj in backward: the gradient grows in rnn and reaches embed through it,
    # so embed grows even more; proj, after rnn, does not grow (10x is the least that counts)
    t = growth_trace(
        {"embed": 1, "rnn": 1, "proj": 1},
        {"embed": [1.0, 2.0, 30.0, 100.0, 230.0], "rnn": [1.0, 1.5, 8.0, 20.0, 43.0],
         "proj": [5.0, 5.5, 6.0, 5.0, 8.0]},
    )
    diagnose(t, strict=True)
    assert t.diagnosis.module == "rnn"  # log 43 >= half of log 230; proj's 1.6x is not


def test_a_tenfold_spike_the_run_pays_for_is_an_error():
    # a 26x spike (below the 100x that is an error by itself), then GradScaler skips the next
    # steps at the scale that had fit the earlier ones: the run pays for it
    norms = [0.62, 0.57, 0.6, 16.0]
    steps = [StepRecord(index=i, loss=7.0, grad_norm=v, scale=65536.0)
             for i, v in enumerate(norms)]
    steps += [StepRecord(index=4, loss=150.0, scale=65536.0, skipped=True),
              StepRecord(index=5, loss=150.0, scale=32768.0, skipped=True)]
    layers = [LayerStats("rnn", "RNN", calls=6, dtypes=["float16"],
                         param_grad_amax_by_step={i: v * 65536 for i, v in enumerate(norms)})]
    t = Trace(run=RunInfo(target="float16", scaler=True), steps=steps, layers=layers)
    diagnose(t, strict=True)
    d = t.diagnosis
    assert (d.rule, d.severity, d.module) == ("exploding-gradient", "error", "rnn")
    assert any("skipped steps 4, 5 right after it" in e for e in d.evidence)
    # the same spike with nothing paid for stays a warning
    t2 = Trace(run=RunInfo(target="float16", scaler=True), steps=steps[:4], layers=layers)
    diagnose(t2, strict=True)
    assert t2.diagnosis is None and t2.warnings[0].rule == "exploding-gradient"


def adam_trace(lr: float, amax: list[float], losses: list[float]) -> Trace:
    layers = [LayerStats("head", "Linear", calls=len(amax), dtypes=["float16"],
                         param_amax_by_step=dict(enumerate(amax)))]
    steps = [StepRecord(index=i, loss=v, grad_norm=1.0) for i, v in enumerate(losses)]
    return Trace(run=RunInfo(target="float16"), steps=steps, layers=layers,
                 optimizers=[OptimizerInfo(type="AdamW", lr=lr)])


def test_adam_weights_growing_by_lr_a_step_is_a_learning_rate_too_high():
    # +1 a step at lr=1: linear growth (1.1, 2.1, 3.1, 4.1, 5.1), 4.6x over the window, which the
    # geometric test (1.5x a step, sustained) misses; the loss stayed above 5x its first value
    # (20) for the last four steps
    t = adam_trace(1.0, [1.1, 2.1, 3.1, 4.1, 5.1], [4.0, 30.0, 40.0, 24.0, 32.0])
    diagnose(t, strict=True)
    d = t.diagnosis
    assert (d.rule, d.kind, d.severity, d.module) == ("weight-growth", "lr_too_high", "error",
                                                      "head")
    assert d.data["increment"] == 1.0 and d.data["optimizer"] == "AdamW"
    # the cut: 0.1% of the weights' median size (3.1) over the step (1.0) is 3.1e-3 -> 1e-3
    assert d.data["lr_factor"] == 1e-3
    assert d.phase == "optimizer"
    # a loss that jumped once and came back is not a loss that stayed high
    t = adam_trace(1.0, [1.1, 2.1, 3.1, 4.1, 5.1], [4.0, 30.0, 4.0, 30.0, 4.0])
    diagnose(t, strict=True)
    assert t.diagnosis is None
    # the same growth with a flat loss and nothing non-finite: a warning
    t = adam_trace(1.0, [1.1, 2.1, 3.1, 4.1, 5.1], [4.0] * 5)
    diagnose(t, strict=True)
    assert t.diagnosis is None and t.warnings[0].rule == "weight-growth"


def test_adam_growth_in_most_layers_names_no_one_layer():
    t = adam_trace(1.0, [1.1, 2.1, 3.1, 4.1, 5.1], [4.0, 30.0, 40.0, 24.0, 32.0])
    t.layers += [LayerStats(n, "Linear", calls=5, dtypes=["float16"],
                            param_amax_by_step=dict(enumerate(v)))
                 for n, v in [("body", [0.5, 1.4, 2.3, 3.2, 4.0]), ("emb", [3.0] * 5)]]
    diagnose(t, strict=True)
    d = t.diagnosis
    # head and body grew by about lr, emb did not: 2 of 3 layers, the lr is everyone's
    assert (d.rule, d.module) == ("weight-growth", None)
    assert d.message.startswith("the weights of 2 of 3 layers (most: body")


def test_adam_at_a_normal_lr_is_quiet():
    # weights that move by lr=1e-3 a step grow by a fraction of a percent
    t = adam_trace(1e-3, [1.1 + 1e-3 * i for i in range(6)], [4.0 - 0.1 * i for i in range(6)])
    diagnose(t, strict=True)
    assert t.diagnosis is None
    assert not [w for w in t.warnings if w.rule == "weight-growth"]


def test_calibration_that_costs_most_of_the_run_is_a_problem():
    # 11 of 16 steps skipped calibrating (65536 -> 32): 69% of the updates never happened
    scales = [65536.0 / 2**i for i in range(11)] + [32.0] * 5
    steps = [StepRecord(index=i, loss=8e3, scale=sc, skipped=i < 11,
                        grad_norm=None if i < 11 else 100.0) for i, sc in enumerate(scales)]
    t = Trace(run=RunInfo(target="float16", scaler=True), steps=steps)
    diagnose(t, strict=True)
    d = t.diagnosis
    assert (d.rule, d.kind, d.phase) == ("skip-streak", "loss_scale", "loss_scaling")
    assert "69% of the run's steps were skipped (11 while the scale calibrated)" in d.message
    assert d.data["summed_loss"]  # the loss of 8e3 a step
    # the same calibration in a 40-step run is 28%: a warning with the init_scale
    steps += [StepRecord(index=i, loss=8e3, scale=32.0, grad_norm=100.0) for i in range(16, 40)]
    t = Trace(run=RunInfo(target="float16", scaler=True), steps=steps)
    diagnose(t, strict=True)
    assert t.diagnosis is None and t.warnings[0].rule == "skip-streak"


def test_a_failure_on_an_untraced_step_names_no_cause():
    f = Failure(3, "forward", "", "loss", TensorStats("float32", [], 1, nan=1))
    steps = [StepRecord(index=i, loss=1.0, traced=i % 2 == 0) for i in range(3)]
    steps.append(StepRecord(index=3, loss=math.nan, traced=False, nonfinite=True))
    t = Trace(run=RunInfo(), steps=steps, first_failure=f, problem=True,
              layers=[LayerStats("fc", "Linear", forward_amax_by_step={0: 1.0, 2: 1.0})])
    diagnose(t, strict=True)
    assert t.diagnosis.rule == "untraced-step" and t.diagnosis.module is None
    assert t.warnings == []
    assert "origin not observed" in verdict(t).headline


def test_nan_is_not_over_the_max_and_zeros_are_counted_apart():
    s = TensorStats("float16", [8], 8, nan=2, zero=3, underflow=2, flushed=1, amax=1e-7)
    text = ", ".join(values_summary(s, FP16))
    assert "over" not in text
    assert "3 exact zeros" in text and "1 subnormal" in text and "1 would flush" in text
    loss = TensorStats("float32", [], 1, posinf=1)
    assert "no finite value" in values_summary(loss, FP16)
    assert shape_text(loss) == "scalar"


def _deep_trace(per_layer: float) -> Trace:
    # 20 Linear layers, each followed by a norm; the backward of layer "4" overflows at step 0.
    # The gradient reaching layer i (backward order from 19 down) is 1e-3 * per_layer**(19 - i)
    layers = []
    for i in range(20):
        amax = 1e-3 * per_layer ** (19 - i)
        layers.append(LayerStats(str(2 * i), "Linear", calls=1, params=64, dtypes=["float16"],
                                 backward_amax_by_step={0: amax}))
        # a norm rescales the gradient: its values do not follow the Linear series
        layers.append(LayerStats(str(2 * i + 1), "BatchNorm1d", calls=1, params=8,
                                 dtypes=["float16"], backward_amax_by_step={0: 0.01}))
    f = Failure(0, "backward", "8", "8.weight.grad", _ts_inf(), op="aten.mm")
    return Trace(run=RunInfo(target="float16", autocast=True), layers=layers,
                 steps=[StepRecord(0, loss=2.3)], first_failure=f,
                 ops=[OpRecord(0, "aten.mm.default", "backward", "float16", 6e4, 2, 64,
                               first_nonfinite=True)])


def _ts_inf() -> TensorStats:
    return TensorStats(dtype="float32", shape=[64], numel=64, posinf=1, neginf=1, amax=6e4)


def test_gradients_growing_layer_by_layer_to_an_overflow_are_an_explosion():
    t = _deep_trace(2.0)
    diagnose(t, strict=True)
    d = t.diagnosis
    assert (d.rule, d.kind, d.phase, d.module) == ("exploding-gradient", "exploding_gradient",
                                                   "backward", "8")
    # the Linear layers after the culprit ("10".."38") carry 1e-3 * 2**k for k = 14..0: the
    # gradient grew 2**14 on its way back, 2x a layer
    assert d.data["depth"]["layers"] == 15
    assert abs(d.data["depth_growth"] - 2.0**14) < 1e-9 * 2.0**14
    # judged against float16, where the matmul made the inf, not the float32 .grad
    assert "overflowed float16" in d.message
    # gradients that do not grow on the way back: the overflow is the layer's own
    t = _deep_trace(1.0)
    diagnose(t, strict=True)
    assert t.diagnosis.rule == "backward-overflow"
