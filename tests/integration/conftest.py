"""Run the real CLI in a subprocess, as a user would: `nanhunt ...` and `python -m nanhunt ...`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _launchers() -> list[list[str]]:
    found = [[sys.executable, "-m", "nanhunt"]]
    exe = shutil.which("nanhunt")
    if exe:
        found.insert(0, [exe])
    return found


@pytest.fixture(params=_launchers(), ids=lambda c: "console-script" if len(c) == 1 else "-m")
def nanhunt_cmd(request):
    return request.param


class Result:
    def __init__(self, proc: subprocess.CompletedProcess, out: Path) -> None:
        self.code = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.out = out

    @property
    def report(self) -> dict:
        return json.loads((self.out / "report.json").read_text())


@pytest.fixture
def run_cli(tmp_path):
    def run(*args: str, cmd: list[str] | None = None, cwd: Path | None = None,
            timeout: float = 180, verify: bool = False) -> Result:
        cmd = cmd or [sys.executable, "-m", "nanhunt"]
        if args[:1] == ("diagnose",) and not verify:
            # re-run verification costs re-runs of the script: only for the tests about it
            args = ("diagnose", "--verify", "0", *args[1:])
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        proc = subprocess.run([*cmd, *args], cwd=cwd or tmp_path, capture_output=True,
                              text=True, timeout=timeout, env=env)
        return Result(proc, (cwd or tmp_path) / "nanhunt-report")

    return run
