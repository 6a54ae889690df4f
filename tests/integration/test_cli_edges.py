"""The CLI's edges as a new user meets them: a fast --help, a missing module, an early Ctrl-C."""

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
from clirun import interruptible, run_nanhunt

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")

# Runs the CLI in-process and says whether torch was imported on the way.
_PROBE = textwrap.dedent("""
    import sys
    from nanhunt.cli.main import main
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
    print("TORCH" if "torch" in sys.modules else "NO-TORCH", code, file=sys.__stderr__)
""")


def _probe(tmp_path: Path, *args: str) -> tuple[bool, int, str]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    verdict, code = last.split()
    return verdict == "TORCH", int(code), proc.stderr


@pytest.fixture(scope="module")
def saved_report(tmp_path_factory) -> Path:
    from nanhunt.report._example import example_trace

    path = tmp_path_factory.mktemp("saved") / "report.json"
    path.write_text(example_trace().to_json(), encoding="utf-8")
    return path


@pytest.mark.parametrize("args", [
    ["--help"], [], ["--version"], ["diagnose", "--help"], ["report", "--help"],
    ["replay", "--help"], ["frobnicate"], ["diagnose"], ["diagnose", "--bogus", "x.py"],
    ["diagnose", "--target", "float13", "x.py"], ["diagnose", "missing.py"],
])
def test_help_and_usage_errors_never_import_torch(tmp_path, args):
    torch_loaded, code, err = _probe(tmp_path, *args)
    assert not torch_loaded, err
    assert code in (0, 2)


def test_report_on_a_saved_report_never_imports_torch(tmp_path, saved_report):
    torch_loaded, code, err = _probe(tmp_path, "report", str(saved_report), "--html",
                                     str(tmp_path / "r.html"))
    assert code == 0, err
    assert not torch_loaded
    assert (tmp_path / "r.html").stat().st_size > 1000


def test_importing_the_package_does_not_import_torch_until_it_is_used(tmp_path):
    code = ("import sys, nanhunt; assert 'torch' not in sys.modules; "
            "h = nanhunt.Hunt; assert 'torch' in sys.modules; print(nanhunt.watch.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "watch"


# ----------------------------------------------------------------------------- -m missing


@pytest.mark.parametrize(("module", "message"), [
    ("missing_mod_xyz", "no module named missing_mod_xyz"),
    ("missing_mod_xyz.train", "no module named missing_mod_xyz"),
    ("realpkg.nope", "no module named realpkg.nope"),
    ("realpkg", "realpkg is a package with no __main__"),
])
def test_missing_module_is_a_one_line_usage_error(tmp_path, module, message):
    (tmp_path / "realpkg").mkdir()
    (tmp_path / "realpkg" / "__init__.py").write_text("")
    proc = run_nanhunt(["diagnose", "-m", module], tmp_path, env=ENV, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"nanhunt: {message}"
    assert not (tmp_path / "nanhunt-report").exists()


def test_an_import_error_inside_the_users_module_is_still_their_crash(tmp_path):
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("import not_installed_dep_xyz\n")
    (tmp_path / "brokenpkg" / "train.py").write_text("print('hi')\n")
    # (through the fork server: python -m nanhunt with torch imported already)
    proc = run_nanhunt(["diagnose", "-m", "brokenpkg.train"], tmp_path, env=ENV, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "ModuleNotFoundError: No module named 'not_installed_dep_xyz'" in proc.stderr


# ----------------------------------------------------------------------------- early Ctrl-C

_LOOP = textwrap.dedent("""
    import torch
    from torch import nn
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    while True:
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
""")

_SHORT = _LOOP.replace("while True:", "for _ in range(3):")


def _interrupt_after(tmp_path: Path, script_text: str, trigger: str) -> tuple[int, list[str]]:
    """Send SIGINT the moment the child has imported ``trigger`` (``-X importtime`` streams each
    finished import to stderr), so that each test hits its phase on a loaded machine too."""
    script = tmp_path / "train.py"
    script.write_text(script_text)
    proc = interruptible([sys.executable, "-X", "importtime", "-m", "nanhunt", "diagnose",
                             str(script)], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("import time:") and line.rstrip().endswith(" " + trigger):
            proc.send_signal(signal.SIGINT)
            break
    else:
        proc.wait()
        pytest.fail(f"{trigger} was never imported: {''.join(seen)[-2000:]}")
    rest = proc.stderr.read()
    proc.wait(timeout=120)
    ours = [ln for ln in (*seen, *rest.splitlines(keepends=True))
            if not ln.startswith("import time:")]
    return proc.returncode, [ln.rstrip("\n") for ln in ours]


@pytest.mark.slow
@pytest.mark.parametrize("trigger", [
    "nanhunt.cli.main",      # nanhunt itself is loaded, main has not run
    "numpy._utils",     # in numpy's import, whose C code once swallowed the KeyboardInterrupt
    "numpy",            # in the middle of torch's import
    "torch.nn",         # later in torch's import
    "nanhunt.capture",  # torch is loaded, the script has not started
])
def test_ctrl_c_before_the_script_starts_is_one_line_and_130(tmp_path, trigger):
    code, err = _interrupt_after(tmp_path, _LOOP, trigger)
    assert code == 130, err
    assert not any("Traceback" in ln for ln in err), err
    if (tmp_path / "nanhunt-report" / "report.json").exists():  # the script had just started
        report = json.loads((tmp_path / "nanhunt-report" / "report.json").read_text())
        assert report["run"]["status"] == "interrupted"
    else:
        assert err == ["nanhunt: interrupted"]


@pytest.mark.slow
@pytest.mark.parametrize("trigger",
                         ["nanhunt.pipeline", "nanhunt.replay.module", "nanhunt.analyse.advise"])
def test_ctrl_c_during_the_analysis_keeps_a_report(tmp_path, trigger):
    code, err = _interrupt_after(tmp_path, _SHORT, trigger)
    assert code == 130, err
    assert not any("Traceback" in ln for ln in err), err
    assert err[-1] == "nanhunt: interrupted"
    report = json.loads((tmp_path / "nanhunt-report" / "report.json").read_text())
    assert len(report["steps"]) == 3  # what the script ran is kept


@pytest.mark.slow
def test_ctrl_c_at_fixed_early_delays(tmp_path, quiet_pool):
    """Wall-clock delays as a user's Ctrl-C lands, within the first second (with no shared CLI
    run alongside: at 0.3 s a busier machine has not finished Python's own start, where no code
    of ours runs yet)."""
    script = tmp_path / "loop.py"
    script.write_text(_LOOP)
    for delay in (0.3, 0.6, 1.0):
        out = tmp_path / f"out-{delay}"
        proc = interruptible([sys.executable, "-m", "nanhunt", "diagnose", "--out", str(out),
                                 str(script)], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, (delay, err)
        assert "Traceback" not in err, (delay, err)
        if (out / "report.json").exists():
            assert json.loads((out / "report.json").read_text())["run"]["status"] \
                == "interrupted"
        else:
            assert err.strip() == "nanhunt: interrupted", (delay, err)


# ----------------------------------------------------------------------------- the script's exit

_TRAIN_THEN_EXIT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    model = {model}
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    sys.exit(3)
""")

_ARGPARSE = textwrap.dedent("""
    import argparse
    import torch
    from torch import nn
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, required=True)
    args = p.parse_args()
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
""")


_EXIT_MODELS = ["nn.Linear(4, 1)",
                "nn.Sequential(nn.Conv1d(1, 2, 3, padding=1), nn.Flatten(), "
                "nn.Linear(8, 1)).float()"]
_ARGPARSE_CASES = [(["--help"], 0), ([], 2), (["--lr", "x"], 2)]


def _exit_script(model: str) -> str:
    text = _TRAIN_THEN_EXIT.format(model=model)
    if "Conv1d" in model:
        text = text.replace("torch.randn(8, 4)", "torch.randn(8, 1, 4)")
    return text


_NORMAL_END = _TRAIN_THEN_EXIT.format(model="nn.Linear(4, 1)").replace("sys.exit(3)", "")


def prefetch(cli) -> dict:
    """The runs of the exit-status tests below, in the session's shared pool
    (tests/integration/conftest.py; started when collection ends), each in a fresh folder, with
    the options as typed here (verify=True: the helper adds no --verify 0)."""
    def run(text: str, *args: str):
        return cli.submit_with_files({"train.py": text}, "diagnose", "{cwd}/train.py", *args,
                                     verify=True, timeout=180)

    runs = {("exit", model): run(_exit_script(model)) for model in _EXIT_MODELS}
    runs["normal"] = run(_NORMAL_END)
    for args, _code in _ARGPARSE_CASES:
        runs["argparse", tuple(args)] = run(_ARGPARSE, *args)
    return runs


@pytest.fixture(scope="module")
def runs(cli) -> dict:
    return prefetch(cli)


def _diagnose(runs: dict, key) -> tuple:
    res = runs[key].result()
    return res, res.report, res.text


@pytest.mark.parametrize("model", _EXIT_MODELS)
def test_the_scripts_own_exit_status_is_recorded_and_said(runs, model):
    proc, report, txt = _diagnose(runs, ("exit", model))
    assert proc.returncode == 3, proc.stderr  # nothing found: the script's code passes on
    assert report["run"]["exit_code"] == 3
    assert len(report["steps"]) == 3
    banner = txt.split("╰")[0]
    assert "the script exited with 3" in banner
    html = proc.html
    assert "the script exited with 3" in html


def test_a_normal_end_records_exit_status_0(runs):
    proc, report, txt = _diagnose(runs, "normal")
    assert proc.returncode == 0, proc.stderr
    assert report["run"]["exit_code"] == 0
    assert "exited with" not in txt.split("╰")[0]
    assert "OK: no non-finite values" in txt


@pytest.mark.parametrize(("args", "code"), _ARGPARSE_CASES)
def test_a_script_that_runs_no_step_gets_no_ok_verdict(runs, args, code):
    proc, report, txt = _diagnose(runs, ("argparse", tuple(args)))
    assert proc.returncode == code, proc.stderr
    assert report["steps"] == []
    assert report["run"]["exit_code"] == code
    banner = txt.split("╰")[0]
    assert "the script exited before any training step" in banner
    assert "OK" not in banner
    if code:
        assert f"the script exited with {code}" in banner
    html = proc.html
    assert "the script exited before any training step" in html
    assert "no non-finite values" not in html


def test_report_into_a_closed_pipe_exits_0_quietly(tmp_path):
    # `nanhunt report r.json | head -1`: head closes the pipe after one line
    from nanhunt.report._example import example_trace
    from nanhunt.trace import StepRecord

    trace = example_trace()
    trace.steps += [StepRecord(i, loss=1.0) for i in range(len(trace.steps), 3000)]
    saved = tmp_path / "report.json"
    saved.write_text(trace.to_json(), encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "nanhunt", "report", str(saved), "--all"],
                            cwd=tmp_path, env=dict(ENV, COLUMNS="80"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # far more than a pipe holds is still to come
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert first.startswith("╭".encode())
    assert proc.returncode == 0, err
    assert err == ""
