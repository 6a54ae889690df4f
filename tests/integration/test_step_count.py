"""A step is a training iteration: an evaluation forward after the last optimizer step is no
new step (60 steps for 60), while an unfinished training step (a crash mid-forward) still is."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from clirun import run_nanhunt

ENV = dict(os.environ, OMP_NUM_THREADS="1")

SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch import nn
    torch.manual_seed(0)
    kind, mode = sys.argv[1], sys.argv[2]
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        batch = lambda: torch.randn(4, 8)
    else:
        model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                              nn.Linear(4 * 6 * 6, 1))
        batch = lambda: torch.randn(4, 1, 6, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = int(sys.argv[3])
    for step in range(steps):
        if mode == "mid-eval" and step == steps // 2:
            with torch.no_grad():
                model.eval(); model(batch()); model.train()
        opt.zero_grad()
        model(batch()).pow(2).mean().backward()
        opt.step()
    if mode == "no_grad":
        model.eval()
        with torch.no_grad():
            print("val", model(batch()).pow(2).mean().item())
    elif mode == "eval-with-grad":  # model.eval() only: grad mode still on
        model.eval()
        print("val", model(batch()).pow(2).mean().item())
    elif mode == "inference_mode":
        with torch.inference_mode():
            print("val", model(batch()).pow(2).mean().item())
    elif mode == "crash-mid-step":  # a training forward that never reached its backward
        out = model(batch())
        raise RuntimeError("out of data")
""")


def _steps(tmp_path, kind: str, mode: str, n: int) -> tuple[int, dict]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"r-{kind}-{mode}"
    proc = run_nanhunt(["diagnose", "--quiet", "--out", str(out), str(script), kind, mode,
                        str(n)], tmp_path, env=ENV, timeout=300)
    return proc.returncode, json.loads((out / "report.json").read_text())


KINDS = ["mlp", "cnn"]
MODES = ["no_grad", "eval-with-grad", "inference_mode", "mid-eval", "none"]
CASES = [(kind, mode, 12) for mode in MODES for kind in KINDS] + [("mlp", "crash-mid-step", 5)]


def prefetch(cli) -> dict:
    """Every run of this module, in the session's shared pool (tests/integration/conftest.py;
    started when collection ends), each in a fresh folder."""
    return {case: cli.call(("step-count", *case), lambda cwd, c=case: _steps(cwd, *c))
            for case in CASES}


@pytest.fixture(scope="module")
def runs(cli) -> dict:
    return prefetch(cli)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_evaluation_forwards_are_not_training_steps(runs, kind, mode):
    code, report = runs[kind, mode, 12].result()
    assert code == 0, report["run"]
    assert [s["index"] for s in report["steps"]] == list(range(12))
    assert all(s["loss"] is not None for s in report["steps"])


def test_an_unfinished_training_step_still_counts(runs):
    code, report = runs["mlp", "crash-mid-step", 5].result()
    assert code == 3
    assert report["run"]["status"] == "crashed"
    assert len(report["steps"]) == 6  # 5 finished, and the one the crash cut short
