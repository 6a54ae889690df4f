"""accelerate's fp16 path (its GradScaler: ``accelerator.backward`` scales, ``clip_grad_norm_``
unscales, the prepared optimizer steps through the scaler) under nanhunt, with the scaler
accelerate makes on CUDA given to it on CPU (tests/scripts/accelerate_fp16.py says how): a
healthy run prints what plain python prints, and a planted forward overflow is named at its
layer and op, as the script planted it, in full and sentinel modes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("accelerate")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "accelerate_fp16.py"


@pytest.fixture(scope="module")
def runs(cli) -> dict:
    return {
        "plain": cli.python(SCRIPT),
        "full": cli.submit("diagnose", "--quiet", SCRIPT),
        "planted-plain": cli.python(SCRIPT, "--plant", "3"),
        "planted": cli.submit("diagnose", "--quiet", "--verify", "0", SCRIPT, "--plant", "3"),
        "planted-sentinel": cli.submit("diagnose", "--quiet", "--verify", "0", "--mode",
                                       "sentinel", SCRIPT, "--plant", "3"),
    }


def test_a_healthy_accelerate_fp16_run_is_unchanged(runs):
    plain = runs["plain"].result()
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.splitlines()
    assert len(lines) == 6 and all(line.endswith("scale 4096.0") for line in lines)
    res = runs["full"].result()
    assert res.code == 0, res.stderr
    assert res.stdout.splitlines() == lines
    report = res.report
    assert report["run"]["scaler"] and report["first_failure"] is None


@pytest.mark.parametrize("mode", ["planted", "planted-sentinel"])
def test_an_overflow_under_accelerates_scaler_is_named_at_its_layer(runs, mode):
    plain = runs["planted-plain"].result().stdout.splitlines()
    first_nan = next(int(line.split()[1]) for line in plain if line.split()[3] == "nan")
    assert first_nan == 3
    res = runs[mode].result()
    assert res.code == 1, res.stderr
    assert res.stdout.splitlines() == plain[: len(res.stdout.splitlines())]
    f = res.report["first_failure"]
    assert (f["step"], f["phase"], f["module"], f["tensor"]) == (3, "forward", "2", "output")
    assert f["op"] == "aten.addmm" and res.report["diagnosis"]["kind"] == "overflow"
