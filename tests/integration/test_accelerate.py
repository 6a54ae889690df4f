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


def prefetch(cli) -> dict:
    """This module's runs, in the session's shared pool (tests/integration/conftest.py; started
    when collection ends)."""
    return {
        "plain": cli.python(SCRIPT),
        "full": cli.submit("diagnose", "--quiet", SCRIPT),
        "planted": cli.submit("diagnose", "--quiet", "--verify", "0", SCRIPT, "--plant", "3"),
    }


@pytest.fixture(scope="module")
def runs(cli) -> dict:
    return prefetch(cli)


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


@pytest.mark.parametrize("mode", ["full", pytest.param("sentinel", marks=pytest.mark.slow)])
def test_an_overflow_under_accelerates_scaler_is_named_at_its_layer(runs, cli, mode):
    plain = runs["plain"].result().stdout.splitlines()
    res = runs["planted"].result() if mode == "full" else cli.submit(
        "diagnose", "--quiet", "--verify", "0", "--mode", "sentinel", SCRIPT, "--plant",
        "3").result()
    assert res.code == 1, res.stderr
    printed = res.stdout.splitlines()
    # the steps before the planted one print what the healthy script prints (nanhunt stops the
    # run in the failing step, before its print; a step printed after it is nan)
    assert len(printed) >= 3 and printed[:3] == plain[:3]
    assert all(line.split()[3] == "nan" for line in printed[3:])
    f = res.report["first_failure"]
    assert (f["step"], f["phase"], f["module"], f["tensor"]) == (3, "forward", "2", "output")
    assert f["op"] == "aten.addmm" and res.report["diagnosis"]["kind"] == "overflow"
