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
