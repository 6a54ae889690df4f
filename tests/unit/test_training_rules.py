"""Rules for failures outside the forward pass, on hand-built traces: where gradients first
flush (cast counts), which module's gradients grow, untraced steps, and honest counts in the
report text. Expected numbers are computed here by hand, never copied from nanhunt's output."""

from __future__ import annotations

import math

from nanhunt.diagnose import diagnose
from nanhunt.formats import get_format
from nanhunt.report._common import shape_text, values_summary, verdict
from nanhunt.trace import (
    CastCounts,
    Failure,
    LayerStats,
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
