"""The TensorBoard export, read back with tensorboard's own event reader."""

from __future__ import annotations

import math

import pytest
from clirun import run_nanhunt

from nanhunt.formats import get_format
from nanhunt.trace import LayerStats, LayerStep, RunInfo, StepRecord, TensorStats, Trace

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)

from nanhunt.report.tensorboard import export_tensorboard


def _stats(amax: float, hist: dict[int, int], zero: int = 0, nan: int = 0) -> TensorStats:
    fmt = get_format("float16")
    n = sum(hist.values()) + zero + nan
    under = sum(c for e, c in hist.items() if e < fmt.min_normal_binade)
    return TensorStats(dtype="float16", shape=[n], numel=n, zero=zero, nan=nan, amax=amax,
                       underflow=under, headroom=fmt.headroom_binades(amax), hist=hist)


def _trace() -> Trace:
    steps = [StepRecord(0, loss=2.0, scale=65536.0, grad_norm=1.5),
             StepRecord(1, loss=1.0, scale=65536.0, skipped=True),
             StepRecord(2, loss=math.nan, scale=32768.0, grad_norm=math.nan)]
    layers = [LayerStats("enc.fc", "Linear", forward_amax_by_step={0: 4.0, 1: 8.0, 2: 100.0},
                         backward_amax_by_step={0: 0.5, 2: 2.0})]
    layer_steps = [
        LayerStep("enc.fc", 1, forward=_stats(8.0, {3: 5, -20: 3}, zero=2)),
        LayerStep("enc.fc", 2, forward=_stats(100.0, {6: 4, 0: 4}),
                  backward=_stats(2.0, {1: 2, -16: 6})),
    ]
    return Trace(run=RunInfo(target="float16"), steps=steps, layers=layers,
                 layer_steps=layer_steps)


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("tb")
    written = export_tensorboard(_trace(), logdir)
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc, written


def _series(acc, tag):
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_step_series(events):
    acc, _ = events
    assert _series(acc, "step/loss")[0] == 2.0
    assert math.isnan(_series(acc, "step/loss")[2])  # a NaN loss stays a NaN, not a 0
    assert _series(acc, "step/loss_scale") == {0: 65536.0, 1: 65536.0, 2: 32768.0}
    assert _series(acc, "step/skipped") == {0: 0.0, 1: 1.0, 2: 0.0}
    assert _series(acc, "step/skipped_total") == {0: 0.0, 1: 1.0, 2: 1.0}
    assert _series(acc, "step/grad_norm")[0] == 1.5


def test_layer_scalars_per_step(events):
    acc, _ = events
    assert _series(acc, "forward_amax/enc.fc") == {0: 4.0, 1: 8.0, 2: 100.0}
    head = _series(acc, "forward_headroom/enc.fc")
    for step, amax in {0: 4.0, 1: 8.0, 2: 100.0}.items():
        assert head[step] == pytest.approx(math.log2(65504 / amax), rel=1e-6)
    # step 1: 3 of the 8 non-zero values sit in binade -20, below float16's smallest normal
    assert _series(acc, "forward_underflow/enc.fc") == pytest.approx({1: 3 / 8, 2: 0.0})
    assert _series(acc, "backward_amax/enc.fc") == {0: 0.5, 2: 2.0}
    assert _series(acc, "backward_underflow/enc.fc") == pytest.approx({2: 6 / 8})


def test_exponent_histograms(events):
    acc, _ = events
    (h1, h2) = acc.Histograms("forward_exponent/enc.fc")
    assert (h1.step, h2.step) == (1, 2)
    v = h1.histogram_value
    assert (v.min, v.max, v.num) == (-20, 3, 8)
    assert v.sum == 5 * 3 + 3 * -20
    # one unit-wide bucket per binade from -20 to 3, plus the empty leading bucket
    counts = dict(zip(v.bucket_limit, v.bucket))
    assert counts[3.5] == 5 and counts[-19.5] == 3
    assert sum(v.bucket) == 8


def test_point_count_matches_what_the_reader_sees(events):
    acc, written = events
    tags = acc.Tags()
    seen = sum(len(acc.Scalars(t)) for t in tags["scalars"]) + \
        sum(len(acc.Histograms(t)) for t in tags["histograms"])
    assert seen == written


def test_unwritable_logdir_is_one_line(tmp_path):
    from nanhunt.errors import NanhuntError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(NanhuntError, match="cannot write TensorBoard events"):
        export_tensorboard(_trace(), blocker / "sub")


def test_cli_report_tensorboard_matches_the_report(tmp_path):
    """`nanhunt report OUT --tensorboard LOGDIR` on a real diagnose run (GradScaler, fp16)."""
    import json
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "scale_collapse.py"
    out, tb = tmp_path / "out", tmp_path / "tb"
    run_nanhunt(["diagnose", "--quiet", "--verify", "0", "--keep-going", "--out", str(out),
                 str(example),
                 "--steps", "4"], tmp_path, timeout=300)
    report = json.loads((out / "report.json").read_text())
    proc = run_nanhunt(["report", str(out), "--tensorboard", str(tb)], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "TensorBoard points" in proc.stderr
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scale = {e.step: e.value for e in acc.Scalars("step/loss_scale")}
    assert scale == {s["index"]: s["scale"] for s in report["steps"] if s["scale"] is not None}
    skipped = {e.step: e.value for e in acc.Scalars("step/skipped")}
    assert skipped == {s["index"]: float(s["skipped"]) for s in report["steps"]}
    for layer in report["layers"]:
        if layer["forward_amax_by_step"]:
            got = {e.step: e.value for e in acc.Scalars(f"forward_amax/{layer['module']}")}
            want = {int(k): v for k, v in layer["forward_amax_by_step"].items()}
            assert got == pytest.approx(want)
