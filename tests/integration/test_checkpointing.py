"""Activation checkpointing (tests/scripts/checkpointed_block.py): the block's forward runs again
in backward; the recomputation is neither counted nor judged a second time, and a NaN inside
the checkpointed block is attributed to the module that made it, in both checkpoint modes."""

from __future__ import annotations

from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "checkpointed_block.py"
MODES = {"non-reentrant": (), "reentrant": ("--reentrant",)}


def prefetch(cli) -> None:
    for extra in MODES.values():
        cli.submit("diagnose", "--quiet", SCRIPT, *extra, "--plant")
        cli.submit("diagnose", "--quiet", SCRIPT, *extra, "--plant-recompute")
    cli.submit("diagnose", "--quiet", SCRIPT)
    cli.python(SCRIPT)


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_inside_the_checkpointed_block_names_its_module_once(cli, mode):
    run = cli.get("diagnose", "--quiet", SCRIPT, *MODES[mode], "--plant")
    assert run.code == 1, run.stderr
    report = run.report
    ff = report["first_failure"]
    # log(|tanh| + 1 - 3) of a negative number: block.2 (Log), in the forward (not recompute)
    assert (ff["step"], ff["phase"], ff["module"], ff["tensor"]) == (2, "forward", "block.2",
                                                                     "output")
    assert report["diagnosis"]["kind"] == "nan_op"
    steps = len(report["steps"])
    assert steps == 3
    calls = {layer["module"]: layer["calls"] for layer in report["layers"]}
    # one call per step for every module, checkpointed or not: recomputes are not counted
    assert calls["block.0"] == calls["block.2"] == calls["stem"] == steps, calls


def test_checkpointing_runs_as_under_python(cli):
    plain = cli.python(SCRIPT).result()
    run = cli.get("diagnose", "--quiet", SCRIPT)
    assert plain.returncode == 0 and run.code == 0, run.stderr
    assert run.stdout == plain.stdout and len(plain.stdout.splitlines()) == 4
    assert run.report["first_failure"] is None
    calls = {layer["module"]: layer["calls"] for layer in run.report["layers"]}
    assert calls["block.1"] == calls["head"] == 4


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_only_the_recomputation_makes_is_attributed_to_its_module(cli, mode):
    """The loop changes the block's Log after the forward of step 2: the forward was finite,
    the recomputation in backward takes sqrt of a negative number, and the gradients go NaN.
    Reentrant checkpointing returns from the module, so its recomputed output is observed;
    torch's non-reentrant one stops before the module returns, so the module's own backward
    is named, with the recomputation said."""
    run = cli.get("diagnose", "--quiet", SCRIPT, *MODES[mode], "--plant-recompute")
    assert run.code == 1, run.stderr
    report = run.report
    ff = report["first_failure"]
    assert (ff["step"], ff["phase"], ff["module"]) == (2, "backward", "block.2")
    if mode == "reentrant":
        assert ff["tensor"] == "output (recomputed)"
        assert ff["stats"]["nan"] > 0
        assert report["diagnosis"]["rule"] == "recompute-diverged"
        assert "forward at this step was finite" in ff["detail"]
    else:
        assert ff["tensor"] == "grad_input[0]"
        assert "recomputed by activation checkpointing in this backward" in ff["detail"]
    calls = {layer["module"]: layer["calls"] for layer in report["layers"]}
    assert calls["block.2"] == calls["stem"] == len(report["steps"]) == 3, calls
