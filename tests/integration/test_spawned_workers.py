"""Workers the script starts itself (``mp.spawn``, ``torch.multiprocessing.start_processes`` with
fork): ``nanhunt diagnose train.py`` against ``python train.py`` on the same script
(tests/scripts/spawn_ddp.py: DDP, gloo, 2 ranks, a NaN in rank 1's batch of step 2).

Every run is its own process group, killed whole if it outlives the timeout, so that a hung worker
fails the test instead of outliving it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "spawn_ddp.py"
TIMEOUT = 150  # seconds; a healthy run takes 10-20 s on a loaded 2-core machine

pytestmark = pytest.mark.slow

FAILING_SPAWN = ("--start-method", "spawn")
HEALTHY_SPAWN = ("--start-method", "spawn", "--nan-rank", "-1")
FAILING_FORK = ("--start-method", "fork")
RAISING_FORK = ("--start-method", "fork", "--nan-rank", "-1", "--raise-rank", "1")


class Run:
    def __init__(self, code: int, stdout: str, stderr: str, cwd: Path) -> None:
        self.code, self.stdout, self.stderr, self.cwd = code, stdout, stderr, cwd

    @property
    def report(self) -> dict:
        return json.loads((self.cwd / "out" / "report.json").read_text())


def _run_group(cmd: list[str], cwd: Path) -> Run:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NANHUNT_RANK_TIMEOUT="30")
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:  # pragma: no cover - the failure being tested
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Run(-9, out, f"hung: {cmd} ran past {TIMEOUT} s\n{err}", cwd)
    return Run(proc.returncode, out, err, cwd)


def _submit(cli, kind: str, args: tuple[str, ...]):
    if kind == "python":
        cmd = [sys.executable, str(SCRIPT), *args]
    elif kind == "experiments":  # nanhunt's default: the experiments after the run
        cmd = [sys.executable, "-m", "nanhunt", "diagnose", "--quiet", "--out", "out",
               str(SCRIPT), *args]
    else:
        cmd = [sys.executable, "-m", "nanhunt", "diagnose", "--verify", "0", "--quiet",
               "--out", "out", str(SCRIPT), *args]
    return cli.call(("spawned", kind, args), lambda cwd: _run_group(cmd, cwd))


def prefetch(cli) -> None:
    for args in (FAILING_SPAWN, HEALTHY_SPAWN, FAILING_FORK, RAISING_FORK):
        _submit(cli, "nanhunt", args)
    for args in (HEALTHY_SPAWN, RAISING_FORK):
        _submit(cli, "python", args)
    _submit(cli, "experiments", FAILING_FORK)


def _get(cli, kind: str, args: tuple[str, ...]) -> Run:
    run = _submit(cli, kind, args).result()
    assert run.code != -9, run.stderr
    return run


def _lines(text: str) -> list[str]:
    """The workers' loss lines and the parent's "done", sorted: two processes write into one
    pipe, so their lines can interleave mid-line."""
    found = re.findall(r"rank \d step \d loss (?:nan|[-+0-9.e]+)|done", text)
    return sorted(found)


@pytest.mark.parametrize("args", [FAILING_SPAWN, FAILING_FORK], ids=["mp.spawn", "fork"])
def test_a_nan_in_rank_1s_batch_stops_every_worker_and_names_rank_1(cli, args):
    run = _get(cli, "nanhunt", args)
    assert run.code == 1, run.stderr
    report = run.report
    ff = report["first_failure"]
    assert (ff["rank"], ff["step"], ff["phase"], ff["tensor"]) == (1, 2, "data", "input[0]")
    assert report["run"]["world_size"] == 2
    ranks = report["ranks"]
    assert [(r["rank"], r["answered"], r["status"]) for r in ranks] == [
        (0, True, "stopped"), (1, True, "stopped")]
    assert [len(r["steps"]) for r in ranks] == [3, 3]  # both stopped after step 2, together
    assert "rank 1 of 2 saw a non-finite value first" in ff["detail"].lower()
    # the workers' own lines are python's up to the stop (the healthy twin's batches are the
    # same before step 2), and the parent stopped before its "done"
    plain = _get(cli, "python", HEALTHY_SPAWN)
    before = [line for line in _lines(plain.stdout) if re.match(r"rank \d step [01] ", line)]
    assert len(before) == 4
    assert _lines(run.stdout) == before
    assert run.stderr == ""  # nothing of nanhunt's: --quiet, and nothing from torch
    assert (run.cwd / "out" / "ranks" / "rank-0.json").exists()
    assert (run.cwd / "out" / "ranks" / "rank-1.json").exists()


def test_the_healthy_twin_prints_what_python_prints_and_reports_both_ranks(cli):
    plain = _get(cli, "python", HEALTHY_SPAWN)
    run = _get(cli, "nanhunt", HEALTHY_SPAWN)
    assert plain.code == 0, plain.stderr
    assert run.code == 0, run.stderr
    # the same losses to the last digit, on both ranks (the interleaving is the OS's)
    assert _lines(run.stdout) == _lines(plain.stdout)
    assert len(_lines(plain.stdout)) == 11  # 2 ranks x 5 steps, and "done"
    assert run.stderr == plain.stderr == ""
    report = run.report
    assert report["first_failure"] is None and report["run"]["status"] == "complete"
    assert [(r["rank"], r["status"], len(r["steps"])) for r in report["ranks"]] == [
        (0, "complete", 5), (1, "complete", 5)]
    # the losses the report holds are the ones the workers printed
    printed = {(int(m[1]), int(m[2])): float(m[3])
               for m in re.finditer(r"rank (\d) step (\d) loss (nan|[-+0-9.e]+)", plain.stdout)}
    for r in report["ranks"]:
        for s in r["steps"]:
            assert s["loss"] == pytest.approx(printed[r["rank"], s["index"]], rel=0, abs=0)


def test_a_worker_that_raises_gives_pythons_traceback_and_a_crash_report(cli):
    plain = _get(cli, "python", RAISING_FORK)
    run = _get(cli, "nanhunt", RAISING_FORK)
    assert plain.code == 1
    assert run.code == 3, run.stderr

    def traceback_of(stderr: str) -> str:  # torch's own warning lines carry a pid and a time
        return "\n".join(line for line in stderr.splitlines() if not re.match(r"[WE]\d{4} ", line))

    assert traceback_of(run.stderr) == traceback_of(plain.stderr)
    assert "planted failure at step 1" in run.stderr
    report = run.report
    assert report["run"]["status"] == "crashed"
    assert report["run"]["error"] == "rank 1: RuntimeError: rank 1: planted failure at step 1"
    assert [r["answered"] for r in report["ranks"]] == [True, True]
    assert "rank 1 raised: RuntimeError: rank 1: planted failure at step 1" in report["notes"]


def test_the_experiments_re_run_the_script_that_starts_the_workers(cli):
    """A script that starts its own workers gets the experiments of a single-process run: each
    re-run is the script again (it starts its workers again), one at a time, its output and
    files kept from the user's. A NaN in one sample of rank 1's batch recurs in the control and
    at lower learning rates and goes with that sample replaced; that data fix is verified."""
    run = _get(cli, "experiments", FAILING_FORK)
    assert run.code == 1, run.stderr
    report = run.report
    ex = report["experiments"]
    by = {e["rung"]: e for e in ex["runs"]}
    assert ex["source"] == "experiments" and ex["control_reproduced"] is True, ex
    assert by["control"]["outcome"] == "recurred"
    assert by["lr-0.1"]["outcome"] == "recurred"
    assert by["skip-samples"]["outcome"] == "trained" and ex["verdict"] == "data"
    assert by["skip-samples"]["fixes"] == ["skip-samples=2:1"]  # x[1, 2] is NaN on rank 1
    rec = next(r for r in report["recommendations"] if r["type"] == "fix_data")
    assert rec["verified"] and rec["fix"] == ["skip-samples=2:1"]
    control = json.loads((run.cwd / "out" / by["control"]["report"]).read_text())
    assert control["run"]["world_size"] == 2 and len(control["ranks"]) == 2
    assert control["first_failure"]["rank"] == 1
    # the re-runs' workers wrote to their own logs: the user's stdout has one run's lines
    assert run.stdout.count("rank 1 step 1 loss") == 1
    assert sorted(p.name for p in run.cwd.iterdir()) == ["out"]
