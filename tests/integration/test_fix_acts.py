"""A --fix either acts on the script or says why not.

An optimizer fix on a script that updates its weights by hand is refused at once: exit 2, one
line, before the script trains on unchanged (it used to run to its failure or its end
unchanged, and a run nanhunt stopped at the failure was never refused). lr-factor on a script
whose schedule sets absolute learning rates acts, and the report says how."""

from __future__ import annotations

from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

CASES = {
    "clip-failing": ("clip=1", ["--lr", "1e30"]),
    "lr-factor-healthy": ("lr-factor=0.1", []),
}


def prefetch(cli) -> dict:
    runs = {name: cli.submit("diagnose", "--fix", spec, SCRIPTS / "hand_sgd.py", *args)
            for name, (spec, args) in CASES.items()}
    runs["schedule"] = cli.submit("diagnose", "--fix", "lr-factor=0.1",
                                  SCRIPTS / "lr_schedule_absolute.py")
    return runs


@pytest.fixture(scope="module")
def runs(cli) -> dict:
    return prefetch(cli)


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_optimizer_fix_without_an_optimizer_is_refused_at_the_first_step(runs, name):
    res = runs[name].result()
    spec = CASES[name][0]
    assert res.code == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"nanhunt: --fix {spec}: "), res.stderr
    assert "no torch optimizer" in lines[0]
    # the script stopped at the end of its first step, before its second
    assert res.stdout.splitlines() == [ln for ln in res.stdout.splitlines()
                                       if ln.startswith("step 0 ")], res.stdout


def test_lr_factor_on_a_schedule_of_absolute_values_is_reported(runs):
    res = runs["schedule"].result()
    assert res.code == 0, res.stderr
    notes = [n for n in res.report["notes"] if n.startswith("--fix lr-factor=0.1: ")]
    assert len(notes) == 1 and "sets the learning rate itself (before step 0" in notes[0]
    assert res.report["run"]["fixes"] == ["lr-factor=0.1"]
