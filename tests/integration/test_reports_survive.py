"""A bug of nanhunt's own in the last transfer of the session (capture/session.py) must not lose
the report (issue 22, item 6): the run's report is written with the error in its notes, the
script's own traceback is printed as Python prints it, the fixes come off, and the exit code
says which happened (4: nanhunt failed; 3: the script did)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# loaded at the child's start (sitecustomize): the session's final flush raises, as a bug would
INJECT = '''
import nanhunt.capture.session as _session

def _boom(self):
    raise RuntimeError("simulated bug in the final flush")

_session.Session._final_flush = _boom
'''

TRAIN = '''
import sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    opt.zero_grad(); model(torch.randn(8, 4)).pow(2).mean().backward(); opt.step()
print("trained")
if sys.argv[1:] == ["crash"]:
    raise ValueError("the script's own error")
'''


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    (tmp_path / "train.py").write_text(TRAIN)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "nanhunt", "diagnose", "--verify", "0",
                           "--fix", "clip=1.0", "train.py", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    report = json.loads((tmp_path / "nanhunt-report" / "report.json").read_text())
    return proc, report


@pytest.mark.parametrize("crash", [False, True], ids=["healthy", "script-crashes"])
def test_an_internal_error_in_the_final_flush_keeps_the_report(tmp_path, crash):
    proc, report = _run(tmp_path, *(["crash"] if crash else []))
    assert proc.stdout == "trained\n"  # the script's own output, untouched
    assert "simulated bug in the final flush" in " ".join(report["notes"])
    assert len(report["steps"]) >= 2  # what the run recorded is kept
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("nanhunt: internal error")]
    assert len(lines) == 1, proc.stderr  # one line of ours, no traceback of ours
    assert "PARTIAL REPORT" in proc.stderr  # not a clean "OK"
    if crash:  # the script's failure wins, with its own traceback
        assert proc.returncode == 3, proc.stderr
        assert "ValueError: the script's own error" in proc.stderr
        assert 'File "' in proc.stderr and "train.py" in proc.stderr
    else:
        assert proc.returncode == 4, proc.stderr
        assert "Traceback" not in proc.stderr
