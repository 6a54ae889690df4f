"""The fork servers that ``nanhunt diagnose`` forks from itself before the user's script runs
(re-run verification's zygotes): driven through tests/scripts/zygote_probe.py in a child of
its own (forking this test process, which has threads, would not be safe)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from clirun import run_python

PROBE = Path(__file__).resolve().parents[1] / "scripts" / "zygote_probe.py"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="zygotes fork on Linux only")
def test_zygotes_run_a_script_per_request_and_keep_nothing_of_their_parent(tmp_path):
    proc = run_python(PROBE, str(tmp_path), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
           for line in proc.stdout.splitlines()}
    assert got["eof"] is True  # no inherited descriptor held open (a caller would hang)
    assert got["ready"] == [{"ready": True}] * 2
    for n in (0, 1):  # each request a fresh child: its argv, folder, environment and exit status
        run = got[f"run{n}"]
        assert run["pid"] and run["code"] == 3
        assert run["out"] == f"argv ['x{n}'] cwd {tmp_path} var {n}\n"
    assert got["exit"] == [0, 0]  # both end when their pipe closes
