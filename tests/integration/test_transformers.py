"""The Hugging Face Trainer (the real package, with accelerate) with nanhunt: the callback in
the run and `nanhunt diagnose` on the same script. The Trainer shuffles, so the reference step
comes from the script's own record of the order in which the Trainer fetched samples."""

from __future__ import annotations

import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import run_nanhunt, run_python

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "frameworks" / \
    "hf_trainer_nan_batch.py"
BAD_SAMPLE, BATCH = 21, 4


class Run:
    def __init__(self, out: Path, stdout: str, stderr: str) -> None:
        self.out, self.stdout = out, stdout
        self.report = json.loads((out / "report.json").read_text())
        self.fetched = [int(i) for i in re.findall(r"^fetch (\d+)$", stderr, flags=re.M)]
        done = re.search(r"done global_step (\d+)", stdout)
        self.final_global_step = int(done.group(1)) if done else None
        # the Trainer's own log lines (logging_steps=1): one per optimizer step
        self.logged = re.findall(r"^\{'loss': '([^']*)', 'grad_norm': '([^']*)'", stdout,
                                 flags=re.M)

    def bad_step(self, accumulate: int = 1) -> int:
        return self.fetched.index(BAD_SAMPLE) // (BATCH * accumulate)

    @property
    def failure(self) -> tuple:
        f = self.report["first_failure"]
        return f["step"], f["phase"], f["module"], f["tensor"]


@pytest.fixture
def run_callback(tmp_path, capsys):
    def run(*args: str) -> Run:
        out = tmp_path / "report"
        saved = sys.argv[:]
        sys.argv = [str(SCRIPT), *args, "--callback", str(out),
                    "--output-dir", str(tmp_path / "hf")]
        try:
            runpy.run_path(str(SCRIPT), run_name="__main__")
        finally:
            sys.argv = saved
        captured = capsys.readouterr()
        return Run(out, captured.out, captured.err)

    return run


@pytest.mark.parametrize("model", ["mlp", "bert"])
def test_nan_sample_found_and_training_stopped(run_callback, model):
    run = run_callback("--model", model)
    step = run.bad_step()
    assert run.failure[:2] == (step, "data")
    rep = run.report
    assert rep["run"]["target"] == "bfloat16"
    assert rep["run"]["target_source"] == "precision (bf16=True)"
    assert [s["index"] for s in rep["steps"]] == list(range(step + 1))
    # control.should_training_stop ended train() right after that step
    assert run.final_global_step == step + 1
    assert rep["run"]["status"] == "stopped"
    # what the Trainer's log showed for that step: logging_nan_inf_filter's substitute, finite
    loss_logged, grad_norm_logged = run.logged[step]
    assert loss_logged != "nan" and float(loss_logged) == float(loss_logged)
    assert grad_norm_logged == "nan"
    assert rep["steps"][step]["loss"] == "nan"


def test_bert_names_the_embedding_input(run_callback):
    run = run_callback("--model", "bert")
    f = run.report["first_failure"]
    assert "inputs_embeds" in f["tensor"]
    assert next(iter(f["bad_samples"].values())) == [run.fetched.index(BAD_SAMPLE) % BATCH]


def test_gradient_accumulation_steps_match_global_step(run_callback):
    run = run_callback("--accumulate", "2")
    step = run.bad_step(accumulate=2)
    assert run.failure[:2] == (step, "data")
    assert len(run.report["steps"]) == run.final_global_step == step + 1
    assert len(run.logged) == run.final_global_step  # one Trainer log line per step


def test_overflow_in_a_half_submodule(run_callback):
    run = run_callback("--fp16-head")
    rep = run.report
    assert run.failure[:3] == (0, "forward", "head")
    # no autocast and no fp16=True: the target comes from the head's float16 parameters
    assert rep["run"]["target"] == "float16"
    assert rep["run"]["target_source"] == "parameters"
    assert rep["diagnosis"]["kind"] == "overflow"
    assert rep["first_failure"]["stats"]["posinf"] + rep["first_failure"]["stats"]["neginf"] > 0


def _cli_diagnose(cwd: Path) -> subprocess.CompletedProcess:
    # --verify 0: the step and the target do not depend on re-runs
    return run_nanhunt(["diagnose", "--quiet", "--verify", "0", "--out", str(cwd / "report"),
                        str(SCRIPT), "--output-dir", str(cwd / "hf")], cwd, timeout=300)


def _crash(cwd: Path) -> subprocess.CompletedProcess:
    script = cwd / "crash.py"
    script.write_text(CRASH)
    # as python runs it (forked: its exit runs the atexit functions that write the report)
    return run_python(script, str(cwd), cwd=cwd, timeout=300)


def prefetch(cli) -> dict:
    """The two subprocess runs, in the session's shared pool (tests/integration/conftest.py;
    started when collection ends), each in a fresh folder: they run while the in-process tests
    above do."""
    return {"cli": cli.call(("hf-cli",), lambda cwd: (cwd, _cli_diagnose(cwd))),
            "crash": cli.call(("hf-crash",), lambda cwd: (cwd, _crash(cwd)))}


def test_cli_diagnose_hf_script(cli):
    tmp_path, proc = prefetch(cli)["cli"].result()
    assert proc.returncode == 1, proc.stderr
    run = Run(tmp_path / "report", proc.stdout, proc.stderr)
    step = run.bad_step()
    assert run.failure[:2] == (step, "data")
    assert run.report["run"]["target"] == "bfloat16"
    assert [s["index"] for s in run.report["steps"]] == list(range(step + 1))


CRASH = """
import sys
import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments
from nanhunt.integrations.transformers import NanhuntCallback

class Samples(Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        return {"x": torch.ones(4) * i, "labels": torch.zeros(1)}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.calls = nn.Linear(4, 1), 0
    def forward(self, x, labels=None):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("data loader broke")
        out = self.fc(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

args = TrainingArguments(output_dir=sys.argv[1] + "/hf", per_device_train_batch_size=4,
                         use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
Trainer(model=Net(), args=args, train_dataset=Samples(),
        callbacks=[NanhuntCallback(out=sys.argv[1] + "/report", quiet=True)]).train()
"""


def test_a_crash_inside_train_still_writes_the_report(cli):
    """The Trainer has no exception hook: the report is written when the process exits."""
    tmp_path, proc = prefetch(cli)["crash"].result()
    assert proc.returncode == 1
    assert "RuntimeError: data loader broke" in proc.stderr  # the user's traceback, as ever
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    assert rep["run"]["status"] == "crashed"
    assert [s["index"] for s in rep["steps"]][:2] == [0, 1]


def _torchrun_hf(cwd: Path, *nanhunt: str, extra: tuple[str, ...] = ()) -> tuple:
    """The example under torchrun, 2 ranks (the Trainer's DDP over gloo): plain, with the
    callback (``--callback cb``), or under ``-m nanhunt diagnose`` (``nanhunt`` options)."""
    import os
    import signal

    target = ["-m", "nanhunt", "diagnose", *nanhunt, str(SCRIPT)] if nanhunt else [str(SCRIPT)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", *target, "--output-dir", str(cwd / "hf"), *extra]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", NANHUNT_RANK_TIMEOUT="30"))
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:  # pragma: no cover - the failure being tested
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"hung: {cmd}\n{err}")
    fetched: dict[int, list[int]] = {0: [], 1: []}
    for i, r in re.findall(r"^fetch (\d+) rank (\d)$", err, flags=re.M):
        fetched[int(r)].append(int(i))
    return proc, fetched


@pytest.mark.slow
def test_the_callback_under_ddp_names_the_rank_that_fetched_the_bad_sample(tmp_path):
    """The HF Trainer under torchrun (DDP over gloo, 2 ranks) with NanhuntCallback: the merged
    report names the rank whose shard held the NaN sample and the step it fetched it at (from
    the script's own per-rank record of the fetch order), both ranks stop after that step, and
    the same script under ``torchrun -m nanhunt diagnose`` (the callback standing aside) gives
    the same answer."""
    proc, fetched = _torchrun_hf(tmp_path, extra=("--callback", "cb"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank = next(r for r, ids in fetched.items() if BAD_SAMPLE in ids)
    step = fetched[rank].index(BAD_SAMPLE) // BATCH
    report = json.loads((tmp_path / "cb" / "report.json").read_text())
    ff = report["first_failure"]
    assert (ff["rank"], ff["step"], ff["phase"], ff["tensor"]) == (rank, step, "data",
                                                                    "input['x']")
    assert report["run"]["world_size"] == 2
    assert [(r["rank"], r["status"], len(r["steps"])) for r in report["ranks"]] == [
        (0, "stopped", step + 1), (1, "stopped", step + 1)]
    cli_dir = tmp_path / "cli"
    cli_dir.mkdir()
    proc, fetched_cli = _torchrun_hf(cli_dir, "--quiet", "--verify", "0",
                                     extra=("--callback", "cb"))
    assert fetched_cli == fetched  # the same samples in the same order on each rank
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert not (cli_dir / "cb").exists()
    cli = json.loads((cli_dir / "nanhunt-report" / "report.json").read_text())
    g = cli["first_failure"]
    assert (g["rank"], g["step"], g["phase"], g["tensor"]) == (rank, step, "data", "input['x']")
    assert any("stood aside" in n for n in cli["notes"])
