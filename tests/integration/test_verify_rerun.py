"""Re-run verification on realistic failing scripts, judged against independent evidence: the
same script run in this process, with and without the fix installed, and what it prints.

A fix counts as verified only when the re-run trains; these tests check that against the
script's own printed losses, not against nanhunt's verdict.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from clirun import interruptible, run_nanhunt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_fixes import run_script  # the in-process runner of the fix tests

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def diagnose(cwd: Path, *args: str, timeout: float = 400) -> tuple[int, str, dict | None]:
    proc = run_nanhunt(["diagnose", *args], cwd, env=ENV, timeout=timeout)
    path = cwd / "nanhunt-report" / "report.json"
    return proc.returncode, proc.stderr, json.loads(path.read_text()) if path.exists() else None


VERIFIED = ("t5_siblings.py", "vae_decoder.py", "transformer_ffn.py", "zero_norm_div.py")
CHECKPOINT = SCRIPTS / "checkpointing.py"


def prefetch(cli) -> dict:
    """This module's runs that need no earlier result, in the session's shared pool
    (tests/integration/conftest.py; started when collection ends), each with the options as
    typed here (verify=True: the helper adds no --verify 0)."""
    runs = {script: cli.submit("diagnose", SCRIPTS / script, verify=True) for script in VERIFIED}
    runs["verify-0"] = cli.submit("diagnose", "--verify", "0", SCRIPTS / "zero_norm_div.py",
                                  verify=True)
    runs["ckpt-ref"] = cli.submit("diagnose", "--verify", "0", CHECKPOINT, verify=True)
    runs["ckpt-work"] = cli.submit("diagnose", CHECKPOINT, verify=True)
    for spec in ("fp32:encoder.blok.*", "fp32"):
        runs[spec] = cli.submit("diagnose", "--fix", spec, SCRIPTS / "zero_norm_div.py",
                                verify=True)
    return runs


@pytest.fixture(scope="module")
def runs(cli) -> dict:
    return prefetch(cli)


def _outcome(res) -> tuple[int, str, dict | None]:
    path = res.out / "report.json"
    return res.code, res.stderr, json.loads(path.read_text()) if path.exists() else None


@pytest.fixture(scope="module")
def reports(runs):
    def get(script: str) -> tuple[int, str, dict]:
        return _outcome(runs[script].result())

    return get


def first_nan(lines: list[str]) -> int | None:
    """The first step whose printed loss is nan (the script's own output)."""
    for line in lines:
        step, loss = line.split()[1], line.split()[-1]
        if loss == "nan":
            return int(step)
    return None


def verified(report: dict) -> dict:
    recs = [r for r in report["recommendations"] if r["verified"]]
    assert recs, [(r["type"], r["verification"]) for r in report["recommendations"]]
    return recs[0]


def test_a_fix_that_only_moves_the_failure_is_not_verified_a_wider_one_is(reports):
    code, stderr, report = reports("t5_siblings.py")
    assert code == 1, stderr
    script = SCRIPTS / "t5_siblings.py"
    original = first_nan(run_script(script))
    assert original == report["first_failure"]["step"] == 2
    rec = verified(report)
    # the region bisection: block 1 alone in float32 moves the failure (block 0's turn), so the
    # siblings are tried together, and the blocks' region trains
    runs = report["experiments"]["runs"]
    moved = [e for e in runs if e["rung"] == "region" and e["outcome"] == "moved"]
    assert moved and all(e["failure_step"] > original for e in moved)
    # the script itself agrees: the narrow region only delays the NaN, the verified one trains
    assert first_nan(run_script(script, fixes=moved[0]["fixes"])) == moved[0]["failure_step"]
    assert first_nan(run_script(script, ["--steps", "12"], fixes=rec["fix"])) is None
    assert "*" in rec["fix"][0]  # a pattern: both blocks
    assert rec["fix"] == [report["experiments"]["region"]] and rec["type"] == "fp32_module"
    assert rec["tries"][-1]["verified"] and rec["tries"][-1]["fixes"] == rec["fix"]
    # the console says the script will be re-run before the first re-run
    assert stderr.index("re-running the script (a control, the experiment ladder, up to 4 "
                        "fixes)") < stderr.index("nanhunt: experiment region (--fix")
    assert report["verification"]["tries"] == len([e for e in runs if e["rung"] == "fix"])


@pytest.mark.parametrize(("script", "culprit"), [
    ("vae_decoder.py", "decoder.up.1"),
    ("transformer_ffn.py", "encoder.layers.0.linear2"),
])
def test_a_region_runs_through_the_next_norm(reports, script, culprit):
    code, stderr, report = reports(script)
    assert code == 1, stderr
    assert report["first_failure"]["module"] == culprit
    rec = verified(report)
    path = SCRIPTS / script
    # float32 for the culprit alone, cast back right after it, is inf again
    assert first_nan(run_script(path, fixes=[f"fp32:{culprit}"])) is not None
    assert first_nan(run_script(path, fixes=rec["fix"])) is None
    spec = rec["fix"][0]
    assert spec != f"fp32:{culprit}"
    assert rec["snippet"].count("run_in_float32(") >= 1
    assert "def run_in_float32" in rec["helper"]


def test_a_floor_on_a_zero_norm_is_verified(reports):
    code, stderr, report = reports("zero_norm_div.py")
    assert code == 1, stderr
    f = report["first_failure"]
    assert (f["step"], f["module"]) == (2, "head.normalize")
    rec = verified(report)
    assert rec["fix"][0].startswith("floor:head.normalize:div=")
    assert first_nan(run_script(SCRIPTS / "zero_norm_div.py", fixes=rec["fix"])) is None
    assert first_nan(run_script(SCRIPTS / "zero_norm_div.py")) == 2
    assert rec["verification"].startswith("verified by re-run: ")
    t = rec["tries"][0]
    assert t["verified"] and t["steps"] == 8 and all(v is not None for v in t["losses"])


def test_a_fix_round_trips_through_diagnose_fix(reports, tmp_path):
    _, _, report = reports("zero_norm_div.py")
    spec = verified(report)["fix"]
    code, stderr, fixed = diagnose(tmp_path, "--verify", "0", *[a for s in spec
                                                                 for a in ("--fix", s)],
                                   str(SCRIPTS / "zero_norm_div.py"))
    assert code == 0, stderr
    assert fixed["first_failure"] is None and fixed["run"]["fixes"] == spec
    assert len(fixed["steps"]) == 8


def test_a_fix_that_matches_nothing_is_one_line_and_exit_2(reports):
    code, stderr, _ = reports("fp32:encoder.blok.*")
    assert code == 2
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith("nanhunt: --fix fp32:encoder.blok.*: 'encoder.blok.*' matches "
                                "no module"), stderr
    assert "Traceback" not in stderr
    code, stderr, _ = reports("fp32")
    assert code == 2 and stderr.strip().startswith("nanhunt: --fix fp32: unknown fix")


def test_reruns_keep_the_users_checkpoint(runs, reports):
    # two runs, each in its own folder: without re-runs (the reference) and with them
    ref, work = runs["ckpt-ref"].result().cwd, runs["ckpt-work"].result().cwd
    code, _, _ = reports("ckpt-ref")
    assert code == 1
    expected = torch.load(ref / "ckpt.pt", weights_only=True)
    code, stderr, report = reports("ckpt-work")
    assert code == 1, stderr
    got = torch.load(work / "ckpt.pt", weights_only=True)
    assert got["step"] == expected["step"] < 7  # the re-runs trained to step 7 elsewhere
    for k, v in expected["model"].items():
        assert torch.equal(got["model"][k].nan_to_num(), v.nan_to_num())
    v = report["verification"]
    assert v["tries"] >= 1
    assert any(r.startswith("torch.save: ckpt.pt") for r in v["redirected"]), v
    assert not list((work / "nanhunt-report" / "reruns").glob("*/files/*"))


def test_ctrl_c_during_verification_keeps_the_report(tmp_path):
    proc = interruptible([sys.executable, "-m", "nanhunt", "diagnose",
                             str(SCRIPTS / "t5_siblings.py")], cwd=tmp_path, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = ""
    deadline = time.monotonic() + 300
    while "re-running the script" not in seen and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen += line
    assert "re-running the script (a control" in seen
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    code = proc.wait(timeout=120)
    assert code == 130, seen + rest  # interrupted, as a Ctrl-C anywhere; the report is kept
    report = json.loads((tmp_path / "nanhunt-report" / "report.json").read_text())
    assert report["verification"]["interrupted"] is True
    assert "interrupted" in rest
    assert not any(r["verified"] for r in report["recommendations"])
    assert report["first_failure"]["module"] == "encoder.block.1.layer.0.DenseReluDense.wo"


def test_verify_0_runs_no_rerun(runs, reports):
    code, stderr, report = reports("verify-0")
    assert code == 1
    assert report["verification"]["tries"] == 0
    assert "re-running" not in stderr
    assert not any(r["verified"] for r in report["recommendations"])
    assert not (runs["verify-0"].result().out / "reruns").exists()
