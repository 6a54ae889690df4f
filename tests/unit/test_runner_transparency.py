"""The runner against a real ``python script.py``: the script prints what it sees, warns and
raises; under nanhunt's runner its stdout and stderr are byte for byte those of python's run
(since Python 3.9 ``python rel/path.py`` gives an absolute ``__file__``, which shows in
warnings and tracebacks). No torch: a plain interpreter runs the runner."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import os, sys, warnings
    import helper  # a sibling module: sys.path[0] is the script's folder
    print("name", __name__)
    print("argv", sys.argv)
    print("file", __file__)
    print("path0", sys.path[0])
    print("cwd", os.getcwd())
    warnings.warn("a warning names the script's file")

    def fail():
        raise ValueError("the traceback names it too")

    fail()
""")

RUNNER = (
    "import sys\n"
    "from nanhunt.cli.runner import Target, print_user_traceback, run_target\n"
    "out = run_target(Target(script=sys.argv[1], args=sys.argv[2:]), KeyboardInterrupt)\n"
    "print_user_traceback(out.error)\n"
    "sys.exit(1)\n"
)


@pytest.mark.parametrize("path", ["proj/train.py", "./proj/../proj/train.py", "link/train.py"])
def test_the_script_sees_and_prints_what_python_gives_it(tmp_path: Path, path: str):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "train.py").write_text(SCRIPT)
    (tmp_path / "proj" / "helper.py").write_text("")
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "train.py").symlink_to(tmp_path / "proj" / "train.py")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    args = [path, "--lr", "1e-3", "--", "x"]
    plain = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True,
                           text=True, env=env, timeout=60)
    ours = subprocess.run([sys.executable, "-c", RUNNER, *args], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=60)
    assert plain.returncode == ours.returncode == 1
    assert f"file {tmp_path}/{path}\n" in plain.stdout  # absolute, not normalised
    assert ours.stdout == plain.stdout
    assert ours.stderr == plain.stderr


@pytest.mark.parametrize("record", ["nanhunt.trace.host_platform()", "platform.platform()"])
def test_recording_the_platform_shows_no_warning_a_second_time(record):
    """A callback records its run mid-script (Lightning's on_train_start). platform.platform()
    runs `uname -p` through subprocess, whose warnings.catch_warnings() resets the record of
    warnings already shown: Lightning's deprecation warning then printed twice. The reference
    is Python itself: the same warning, warned twice from one place, shows once."""
    code = textwrap.dedent(f"""
        import platform, warnings
        import nanhunt.trace
        def warn():
            warnings.warn("shown once")
        warn()
        {record}
        warn()
    """)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    shown = proc.stderr.count("UserWarning: shown once")
    assert shown == (1 if record.startswith("nanhunt") else 2), proc.stderr
