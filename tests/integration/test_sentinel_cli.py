"""`nanhunt diagnose --mode sentinel`: the same first failure as `--mode full` on the same
script, found without tracing the steps before it; the script's own output unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import run_nanhunt

SCRIPT = '''
import sys, torch
from torch import nn
arch = sys.argv[1]
torch.manual_seed(0)
if arch == "mlp":
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    shape = (16, 8)
else:
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 36, 1))
    shape = (8, 1, 6, 6)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(20):
    x = torch.randn(*shape)
    if step >= 12:
        x = x * 1e5  # overflows float16 from step 12 on
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    if step % 5 == 0:
        print("step", step, "ok")
'''


def _run(cwd: Path, mode: str, arch: str) -> tuple[subprocess.CompletedProcess, dict]:
    script = cwd / "train.py"
    script.write_text(SCRIPT)
    out = cwd / f"report-{mode}-{arch}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    # --verify 0: where the failure is and what the script printed do not depend on re-runs
    proc = run_nanhunt(["diagnose", "--mode", mode, "--verify", "0", "--out", str(out),
                        "--quiet", str(script), arch], cwd, env=env, timeout=300)
    return proc, json.loads((out / "report.json").read_text())


def prefetch(cli) -> dict:
    """The four runs, in the session's shared pool (tests/integration/conftest.py; started when
    collection ends), each in a fresh folder; and the runs of a script that saves its model."""
    for mode in _SAVE_MODES:
        _saves_model(cli, mode)
    return {(mode, arch): cli.call(("sentinel-cli", mode, arch),
                                   lambda cwd, m=mode, a=arch: _run(cwd, m, a))
            for mode in ("full", "sentinel") for arch in ("mlp", "cnn")}


@pytest.fixture(scope="module")
def runs(cli):
    return {key: fut.result() for key, fut in prefetch(cli).items()}


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_sentinel_mode_finds_what_full_tracing_finds(runs, arch):
    full_proc, full = runs[("full", arch)]
    proc, rep = runs[("sentinel", arch)]
    where = lambda f: (f["step"], f["phase"], f["module"], f["tensor"])  # noqa: E731
    assert where(full["first_failure"])[0] == 12
    assert where(rep["first_failure"]) == where(full["first_failure"])
    assert rep["diagnosis"]["kind"] == full["diagnosis"]["kind"]
    assert rep["run"]["mode"] == "sentinel" and full["run"]["mode"] == "full"
    assert rep["run"]["status"] == "stopped" and proc.returncode == full_proc.returncode == 1
    assert proc.stdout == full_proc.stdout == "step 0 ok\nstep 5 ok\nstep 10 ok\n"  # stopped at 12
    # the steps before the failure carry the cheap scalars only
    early = next(s for s in rep["steps"] if s["index"] == 8)
    assert early["records"] == 0 and early["loss"] is not None
    assert any("replayed with full tracing" in n for n in rep["notes"])


def test_sample_every_is_refused_with_sentinel(tmp_path):
    proc = run_nanhunt(["diagnose", "--mode", "sentinel", "--sample-every", "5", "train.py"],
                       tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "nanhunt: --sample-every applies to --mode full only"


SAVES_MODEL = '''
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    opt.zero_grad(); model(torch.randn(8, 4)).pow(2).mean().backward(); opt.step()
    torch.save(model, "model.pt")
'''

_SAVE_MODES = {
    "full": ("diagnose", "train.py"),
    "sentinel": ("diagnose", "--mode", "sentinel", "train.py"),
    "sampled": ("diagnose", "--sample-every", "2", "train.py"),
    "audit": ("audit", "--steps", "2", "train.py"),
}


def _saves_model(cli, mode):
    return cli.submit_with_files({"train.py": SAVES_MODEL}, *_SAVE_MODES[mode])


@pytest.mark.parametrize("mode", list(_SAVE_MODES))
def test_a_script_that_saves_its_whole_model_runs_unchanged_in_every_mode(cli, mode, tmp_path):
    # the plain run's checkpoint is the reference
    (tmp_path / "train.py").write_text(SAVES_MODEL)
    plain = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert plain.returncode == 0, plain.stderr
    r = _saves_model(cli, mode).result()
    assert r.code == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert (r.cwd / "model.pt").read_bytes() == (tmp_path / "model.pt").read_bytes()
