"""A script that starts nanhunt itself (``nanhunt.sentinel``, ``nanhunt.watch``, a framework
callback) run under ``nanhunt diagnose``: the script's own session stands aside (it installs
nothing and writes nothing), the CLI's traces the run, and the script's output is python's up
to the failing step. Before, the script crashed with "another nanhunt session is already
active in this process" and the report said it stopped before any training step."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SCRIPT = '''
import sys
import torch, torch.nn as nn, nanhunt
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
session = nanhunt.{api}(model, opt{options})
with session as s:
    for step in range(20):
        x = torch.randn(16, 8)
        if step == 12:
            x[3, 2] = float("nan")
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        print(step, repr(loss.item()))
print("after", s.first_failure and s.first_failure.where())
'''

def prefetch(cli) -> dict:
    """Three runs: the sentinel script under nanhunt diagnose, the watch script under it with
    --keep-going, and the watch script under python (the reference: its lines up to step 12
    are those of the sentinel script, which trains the same model on the same batches)."""
    sentinel = {"train.py": SCRIPT.format(api="sentinel", options=', out="own-report", stop=True')}
    watch = {"train.py": SCRIPT.format(api="watch", options="")}
    return {"sentinel": cli.submit_with_files(sentinel, "diagnose", "--quiet", "train.py"),
            "keep-going": cli.submit_with_files(watch, "diagnose", "--quiet", "--keep-going",
                                                "train.py"),
            "python": cli.python_with_files(watch, "train.py")}


def test_the_scripts_own_sentinel_stands_aside_under_the_cli(cli):
    runs = prefetch(cli)
    run, plain = runs["sentinel"].result(), runs["python"].result()
    assert plain.returncode == 0, plain.stderr
    assert run.returncode == 1, run.stderr
    assert "another nanhunt session" not in run.stderr
    ff = run.report["first_failure"]
    assert (ff["step"], ff["phase"], ff["tensor"]) == (12, "data", "input[0]")
    assert any("stood aside" in n and "nanhunt.sentinel" in n for n in run.report["notes"])
    # the script printed what python printed, up to the failing step, in which the CLI stopped
    # it (as it stops any script)
    python_lines = plain.stdout.splitlines()
    assert run.stdout.splitlines() == python_lines[:12]
    assert python_lines[12].startswith("12 nan")
    # the script's own session wrote nothing (its report folder is not made)
    assert not (run.cwd / "own-report").exists()


def test_the_scripts_session_answers_with_the_clis_first_failure(cli):
    """nanhunt.watch under --keep-going: the script runs to its end, every line it prints is
    python's, and its own session's first_failure, read after the loop, is the one nanhunt
    diagnose found (a script that decides on it, to stop or not to save a checkpoint, decides
    as under python)."""
    runs = prefetch(cli)
    run, plain = runs["keep-going"].result(), runs["python"].result()
    assert run.returncode == 1, run.stderr
    assert any("stood aside" in n and "nanhunt.watch" in n for n in run.report["notes"])
    ours, theirs = run.stdout.splitlines(), plain.stdout.splitlines()
    assert ours[:-1] == theirs[:-1] and len(ours) == 21  # 20 steps, bit for bit
    assert theirs[-1].startswith("after step 12 / data / ")
    assert ours[-1] == "after step 12 / data / model / input[0]"  # the CLI's names
    assert not (run.cwd / "own-report").exists()


@pytest.mark.slow
def test_a_lightning_callback_stands_aside_under_the_cli(cli):
    """examples/frameworks/lightning_nan_batch.py with NanhuntCallback (``--callback cb``) under
    nanhunt diagnose: the CLI's answer is the one it gives without the callback, and the
    callback writes no report."""
    script = EXAMPLES / "frameworks" / "lightning_nan_batch.py"
    run = cli.submit("diagnose", "--quiet", script, "--callback", "cb").result()
    assert run.returncode == 1, run.stderr
    ff = run.report["first_failure"]
    assert (ff["step"], ff["phase"], ff["module"], ff["tensor"]) == (5, "data", "model",
                                                                      "input[0]")
    assert any("stood aside" in n and "callback" in n for n in run.report["notes"])
    assert not (run.cwd / "cb").exists()
