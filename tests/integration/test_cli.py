"""The CLI end to end: transparency, exit codes, crash and interrupt paths, reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from clirun import interruptible

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SHOW = textwrap.dedent("""
    import os, sys
    import helper   # a sibling module: sys.path[0] must be the script's folder
    print("name", __name__)
    print("argv", sys.argv)
    print("file", __file__)
    print("cwd", os.getcwd())
    print("path0", sys.path[0])
    import warnings
    warnings.warn("the script's own warning")  # names __file__ on stderr
    if __name__ == "__main__":
        sys.exit(int(sys.argv[-1]))
""")


SHOW_FILES = {"proj/helper.py": "X = 1\n", "proj/show.py": SHOW}
SHOW_ARGS = ["--lr", "1e-3", "--", "--out", "x", "0"]


def _show_under_both(cwd: Path, cmd: list[str], env: dict[str, str],
                     ) -> tuple[Path, subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """show.py (a sibling module beside it) under plain python and under nanhunt, from the
    same folder: what each printed."""
    for name, text in SHOW_FILES.items():
        (cwd / name).parent.mkdir(parents=True, exist_ok=True)
        (cwd / name).write_text(text)
    script = cwd / "proj" / "show.py"
    args = ["proj/show.py", *SHOW_ARGS]  # relative, as typed: python's __file__ is absolute
    plain = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True)
    ours = subprocess.run([*cmd, "diagnose", "--verify", "0", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=180, env=env)
    return script, plain, ours


# scripts of the tests below, written into each run's own folder
KI = "raise KeyboardInterrupt\n"
MODULE = {"mypkg/__init__.py": "", "mypkg/train.py": textwrap.dedent("""
    import sys
    print("name", __name__, "argv", sys.argv[1:])
""")}
CRASH = textwrap.dedent("""
    import torch
    from torch import nn
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(8, 4)
        if step == {nan_step}:
            x[0, 0] = float("nan")
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    def broken():
        raise ValueError("dataset file missing")
    broken()
""")
FP32 = textwrap.dedent("""
    import torch
    from torch import nn
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(1e4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(2):
        opt.zero_grad()
        model(torch.full((2, 4), 10.0)).sum().backward()
        opt.step()
""")


def prefetch(cli) -> dict:
    """This module's runs that import torch, in the session's shared pool
    (tests/integration/conftest.py; started when collection ends), each in a fresh folder; the
    quick ones (usage errors, --help) run in the tests."""
    # the first launcher (the console script where installed) in the default suite; the other
    # (python -m nanhunt, the launcher of every other CLI test) with -m slow, run on demand
    runs = {("show", tuple(cmd)): _show(cli, cmd) for cmd in cli.launchers()[:1]}
    runs["exit-4"] = cli.submit_with_files(SHOW_FILES, "diagnose", "{cwd}/proj/show.py", "4")
    runs["module"] = cli.submit_with_files(MODULE, "diagnose", "--quiet", "-m", "mypkg.train",
                                           "--flag", "v")
    runs["crash"] = cli.submit_with_files({"crash.py": CRASH.format(nan_step=99)}, "diagnose",
                                          "{cwd}/crash.py")
    runs["crash-nan"] = cli.submit_with_files({"crash.py": CRASH.format(nan_step=1)},
                                              "diagnose", "--keep-going", "{cwd}/crash.py")
    runs["ki"] = cli.submit_with_files({"ki.py": KI}, "diagnose", "{cwd}/ki.py")
    runs["max-steps"] = cli.submit("diagnose", "--max-steps", "3", EXAMPLES / "healthy_fp16.py")
    runs["ffn"] = cli.submit("diagnose", EXAMPLES / "ffn_overflow.py")
    runs["healthy"] = cli.submit("diagnose", EXAMPLES / "healthy_fp16.py")
    runs["target"] = cli.submit_with_files({"fp32.py": FP32}, "diagnose", "--target",
                                           "bfloat16", "{cwd}/fp32.py")
    return runs


@pytest.fixture(scope="module")
def runs(cli) -> dict:
    return prefetch(cli)


def _show(cli, cmd):
    return cli.call(("cli-show", tuple(cmd)),
                    lambda cwd, c=cmd: _show_under_both(cwd, c, cli.env()))


@pytest.mark.parametrize("launcher", [
    pytest.param(0, id="first"), pytest.param(1, id="second", marks=pytest.mark.slow)])
def test_script_sees_what_python_gives_it(launcher, cli):
    launchers = cli.launchers()
    if launcher >= len(launchers):
        pytest.skip("one launcher only (no nanhunt console script on PATH)")
    script, plain, ours = _show(cli, launchers[launcher]).result()
    assert plain.returncode == 0
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == plain.stdout  # nanhunt leaves the script's stdout alone
    assert "argv ['proj/show.py', '--lr', '1e-3', '--', '--out', 'x', '0']" in ours.stdout
    assert f"file {script}\n" in ours.stdout
    warning = plain.stderr.splitlines()[:2]
    assert warning[0].startswith(f"{script}:") and "UserWarning" in warning[0]
    assert ours.stderr.splitlines()[:2] == warning  # the same lines, the same path


def test_sys_exit_code_passes_through(runs):
    assert runs["exit-4"].result().code == 4


def test_module_mode(runs):
    res = runs["module"].result()
    assert res.code == 0, res.stderr
    assert "name __main__ argv ['--flag', 'v']" in res.stdout


def test_missing_script_is_a_one_line_usage_error(run_cli):
    res = run_cli("diagnose", "nope.py")
    assert res.code == 2
    assert res.stderr.strip() == "nanhunt: no such script: nope.py"


@pytest.mark.parametrize("args", [["diagnose", "--target", "float13", "x.py"],
                                  ["diagnose", "--max-steps", "0", "x.py"],
                                  ["diagnose"], ["frobnicate"], ["diagnose", "--bogus", "x.py"]])
def test_bad_usage_exits_2_without_traceback(run_cli, args):
    res = run_cli(*args)
    assert res.code == 2
    assert "Traceback" not in res.stderr
    assert res.stderr.startswith("nanhunt: ")
    assert len(res.stderr.strip().splitlines()) == 1


def test_help_documents_exit_codes(run_cli):
    res = run_cli("diagnose", "--help")
    assert res.code == 0
    for code in ("0 ", "1 ", "2 ", "3 ", "130"):
        assert code in res.stdout




def test_crash_prints_the_users_traceback_and_writes_a_partial_report(runs):
    res = runs["crash"].result()
    assert res.code == 3
    assert "Traceback (most recent call last)" in res.stderr
    assert 'ValueError: dataset file missing' in res.stderr
    assert "nanhunt" + os.sep not in res.stderr.split("ValueError")[0]  # our frames hidden
    assert "runpy" not in res.stderr
    report = res.report
    assert report["run"]["status"] == "crashed"
    assert report["run"]["error"] == "ValueError: dataset file missing"
    assert len(report["steps"]) == 3


def test_crash_after_a_numeric_problem_exits_1(runs):
    res = runs["crash-nan"].result()
    assert res.code == 1
    report = res.report
    assert report["first_failure"]["step"] == 1
    assert report["first_failure"]["phase"] == "data"


def test_keyboard_interrupt_gives_exit_130_and_a_partial_report(runs):
    res = runs["ki"].result()
    assert res.code == 130
    assert res.report["run"]["status"] == "interrupted"


def test_real_ctrl_c_during_training(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        x = torch.randn(8, 4)
        step = 0
        while True:  # one batch, a tiny lr: the loss falls at a steady pace (no stall)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            step += 1
            if step == 5:
                print("ready", flush=True)
    """))
    proc = interruptible([sys.executable, "-m", "nanhunt", "diagnose", str(script)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    report = json.loads((tmp_path / "nanhunt-report" / "report.json").read_text())
    assert report["run"]["status"] == "interrupted"
    assert len(report["steps"]) >= 5


def test_max_steps_stops_the_script(runs):
    res = runs["max-steps"].result()
    assert res.code == 0, res.stderr
    assert len(res.report["steps"]) == 3
    assert res.report["run"]["status"] == "stopped"


def test_ffn_overflow_example(runs):
    # one launcher: test_script_sees_what_python_gives_it runs both entry points
    res = runs["ffn"].result()
    assert res.code == 1, res.stderr
    f = res.report["first_failure"]
    assert (f["step"], f["phase"], f["module"], f["tensor"]) == (
        3, "forward", "encoder.blocks.1.ffn.wo", "output")
    assert f["op"] == "aten.addmm"
    assert f["source"].endswith("ffn_overflow.py:" + f["source"].rsplit(":", 1)[1])
    assert "self.wo" in f["source_line"]
    for name in ("report.json", "report.html", "report.txt", "snapshot.pt"):
        assert (res.out / name).exists(), name


def test_healthy_example_exits_0(runs):
    res = runs["healthy"].result()
    assert res.code == 0, res.stderr
    assert res.report["first_failure"] is None
    assert res.report["problem"] is False


def test_target_option_judges_an_fp32_run_against_bfloat16(runs):
    res = runs["target"].result()
    assert res.code == 0, res.stderr
    assert res.report["run"]["target"] == "bfloat16"
    layer = res.report["layers"][0]
    assert layer["forward"]["amax"] == pytest.approx(4e5, rel=1e-3)
