"""Lightning (the real package) with nanhunt: the callback in the run, and `nanhunt diagnose`
on the same script. The reference for every step number is what the script itself printed:
``trainer.global_step`` and the loss of each training batch, read inside ``training_step``."""

from __future__ import annotations

import json
import math
import re
import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "frameworks"
NAN_BATCH = EXAMPLES / "lightning_nan_batch.py"
MANUAL = EXAMPLES / "lightning_manual.py"
_LINE = re.compile(r"batch (\d+) global_step (\d+) loss (\S+)")


class Run:
    def __init__(self, out: Path, stdout: str) -> None:
        self.out, self.stdout = out, stdout
        self.report = json.loads((out / "report.json").read_text())
        # global_step -> the losses training_step printed for it (LBFGS: one per closure call)
        self.printed: dict[int, list[float]] = {}
        for _batch, step, loss in _LINE.findall(stdout):
            self.printed.setdefault(int(step), []).append(float(loss))
        self.batches = len(_LINE.findall(stdout))
        done = re.search(r"done global_step (\d+)", stdout)
        self.final_global_step = int(done.group(1)) if done else None

    @property
    def failure(self) -> tuple:
        f = self.report["first_failure"]
        return f["step"], f["phase"], f["module"], f["tensor"]


def _in_process(script: Path, args: list[str], tmp: Path, capsys) -> Run:
    """Run the example in this process (Lightning imports once for the whole module)."""
    out = tmp / "report"
    saved = sys.argv[:]
    sys.argv = [str(script), *args, "--callback", str(out)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved
    return Run(out, capsys.readouterr().out)


@pytest.fixture
def run_callback(tmp_path, capsys):
    return lambda script, *args: _in_process(script, list(args), tmp_path, capsys)


def _losses_match(run: Run) -> None:
    """nanhunt's loss for step i is the loss training_step printed at global_step i."""
    for s in run.report["steps"]:
        printed = run.printed[s["index"]]
        loss = s["loss"]
        if loss == "nan":
            assert math.isnan(printed[-1])
        else:
            assert any(abs(loss - p) <= 1e-4 * max(1.0, abs(p)) for p in printed), (s, printed)


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_bf16_nan_batch_callback_stops_at_step_5(run_callback, arch):
    run = run_callback(NAN_BATCH, "--arch", arch)
    rep = run.report
    assert run.failure[:2] == (5, "data")
    assert run.failure[3] == "input[0]"
    assert rep["first_failure"]["bad_samples"] == {"input[0]": [3]}
    # 16-mixed on CPU is bf16-mixed: judged against bfloat16, from Lightning's precision
    assert rep["run"]["target"] == "bfloat16"
    assert rep["run"]["target_source"] == "precision (bf16-mixed)"
    assert rep["run"]["framework"].startswith("lightning ")
    # one nanhunt step per optimizer step, numbered like trainer.global_step
    assert [s["index"] for s in rep["steps"]] == list(range(6))
    _losses_match(run)
    # the callback stopped fit() through trainer.should_stop right after batch 5
    assert run.batches == 6 and run.final_global_step == 6
    assert rep["run"]["status"] == "stopped"
    assert rep["diagnosis"]["kind"] == "bad_input"
    assert (run.out / "report.html").exists() and (run.out / "report.txt").exists()


def test_the_summary_never_joins_the_scripts_stdout(run_callback, capsys):
    """The script's stdout is only what it printed; the summary waits for the process's end
    and goes to stderr, under a first line that starts with 'nanhunt'."""
    from nanhunt.integrations import _session

    run = run_callback(NAN_BATCH)  # not quiet
    script_lines = [ln for ln in run.stdout.splitlines() if ln.strip()]
    assert script_lines and all(_LINE.match(ln) or ln.startswith("done global_step")
                                for ln in script_lines), script_lines[-5:]
    assert [out for _, out in _session._pending] == [run.out]
    _session._print_pending()  # what the interpreter's exit runs
    captured = capsys.readouterr()
    assert captured.out == ""
    first = captured.err.splitlines()[0]
    assert first == f"nanhunt: the training callback's summary (reports in {run.out})"
    assert "step 5" in captured.err and not _session._pending


def test_keep_going_trains_to_the_end(run_callback):
    run = run_callback(NAN_BATCH, "--keep-going")
    assert run.failure[:2] == (5, "data")
    assert run.batches == 8 and run.final_global_step == 8
    assert len(run.report["steps"]) == 8


def test_sampled_mode_traces_every_fifth_step_fully(run_callback):
    run = run_callback(NAN_BATCH, "--sample-every", "5")
    steps = run.report["steps"]
    assert [s["index"] for s in steps] == list(range(6))
    _losses_match(run)  # the cheap check keeps every step's loss
    # between sampled steps: the loss and the 4 updated parameters (2 Linear x weight, bias)
    assert [s["records"] for s in steps[1:5]] == [1 + 4] * 4
    assert steps[0]["records"] > 5 and steps[5]["records"] > 5  # module rows too
    assert run.failure[:2] == (5, "data")  # step 5 is a sampled one: the origin is exact


@pytest.mark.parametrize("extra", [[], ["--optimizer", "lbfgs"]], ids=["sgd", "lbfgs"])
def test_training_is_bit_identical_with_the_callback(tmp_path, capsys, extra):
    """Every loss the script prints (repr: every bit of the float) is the same with and
    without the callback."""
    saved = sys.argv[:]
    outputs = []
    for with_callback in (False, True):
        sys.argv = [str(NAN_BATCH), "--keep-going", *extra]
        if with_callback:
            sys.argv += ["--callback", str(tmp_path / "r")]
        try:
            runpy.run_path(str(NAN_BATCH), run_name="__main__")
        finally:
            sys.argv = saved
        outputs.append(_LINE.findall(capsys.readouterr().out))
    assert outputs[0] == outputs[1] and len(outputs[0]) >= 8


def test_sentinel_mode_finds_the_batch_from_its_replay(run_callback):
    import nanhunt.capture as cap

    if not hasattr(cap, "Sentinel"):
        pytest.skip("this nanhunt has no sentinel mode yet")
    run = run_callback(NAN_BATCH, "--sentinel")
    rep = run.report
    assert rep["run"]["mode"] == "sentinel"
    assert run.failure[:2] == (5, "data")
    assert rep["first_failure"]["bad_samples"] == {"input[0]": [3]}
    assert rep["run"]["target"] == "bfloat16"
    assert [s["index"] for s in rep["steps"]] == list(range(6))
    _losses_match(run)
    assert run.final_global_step == 6


def test_lbfgs_closure_called_three_times_is_one_step(run_callback):
    run = run_callback(NAN_BATCH, "--optimizer", "lbfgs")
    assert all(len(v) == 3 for v in run.printed.values())  # max_iter=3 closure calls a step
    assert [s["index"] for s in run.report["steps"]] == list(range(6))
    assert run.failure[:2] == (5, "data")
    _losses_match(run)


def test_gradient_accumulation_two_batches_a_step(run_callback):
    run = run_callback(NAN_BATCH, "--accumulate", "2")
    # batch 5 is the second half of the step taken at global_step 2
    assert run.printed[2] and len(run.printed[2]) == 2
    assert run.failure[:2] == (2, "data")
    assert [s["index"] for s in run.report["steps"]] == [0, 1, 2]
    assert run.final_global_step == 3


def test_validation_and_sanity_check_are_not_steps(run_callback):
    run = run_callback(NAN_BATCH, "--validate")
    assert [s["index"] for s in run.report["steps"]] == list(range(6))
    assert run.failure[:2] == (5, "data")
    _losses_match(run)


def test_gradscaler_of_the_mixed_precision_plugin_is_observed(run_callback):
    run = run_callback(NAN_BATCH, "--scaler", "--keep-going")
    rep = run.report
    assert rep["run"]["scaler"] is True
    assert rep["run"]["target"] == "float16"
    steps = {s["index"]: s for s in rep["steps"]}
    assert steps[0]["scale"] == 65536.0
    # Lightning counts the step GradScaler skipped (global_step still advances): nanhunt marks it
    assert steps[5]["skipped"] is True
    assert [i for i, s in steps.items() if s["skipped"]] == [5]
    assert run.final_global_step == 8 and len(steps) == 8
    assert run.failure[:2] == (5, "data")


@pytest.mark.parametrize("arch", ["mlp", "rnn"])
def test_manual_optimisation(run_callback, arch):
    run = run_callback(MANUAL, "--arch", arch)
    assert run.failure[:2] == (3, "data")
    assert run.report["first_failure"]["bad_samples"] == {"input[0]": [6]}
    assert [s["index"] for s in run.report["steps"]] == [0, 1, 2, 3]
    assert run.report["run"]["target"] == "bfloat16"
    _losses_match(run)
    assert run.final_global_step == 4


def test_overflow_in_a_half_conv_head(run_callback):
    """The sibling of the HF Trainer's .half() MLP head: a conv head under 32-true."""
    run = run_callback(NAN_BATCH, "--fp16-head")
    rep = run.report
    assert run.failure == (0, "forward", "head", "output")
    assert rep["first_failure"]["op"] == "aten.convolution"
    assert (rep["run"]["target"], rep["run"]["target_source"]) == ("float16", "parameters")
    assert rep["diagnosis"]["kind"] == "overflow"
    assert math.isinf(run.printed[0][0])  # the script's own loss was inf
    assert run.final_global_step == 1  # stopped after step 0


def test_tensorboard_from_the_callback(run_callback, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    run = run_callback(NAN_BATCH, "--tensorboard", str(tb))
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    loss = {e.step: e.value for e in acc.Scalars("step/loss")}
    assert sorted(loss) == list(range(6))
    assert math.isnan(loss[5])
    for step in range(5):
        assert loss[step] == pytest.approx(run.printed[step][0], rel=1e-4)
    amax = {e.step: e.value for e in acc.Scalars("forward_amax/body.0")}
    layer = next(x for x in run.report["layers"] if x["module"] == "body.0")
    assert amax == {int(k): v for k, v in layer["forward_amax_by_step"].items()}
    assert acc.Histograms("forward_exponent/body.0")


# ----------------------------------------------------------------------------- the CLI


def prefetch(cli):
    """The CLI run, in the session's shared pool (tests/integration/conftest.py; started when
    collection ends): it runs while the in-process tests above do."""
    return cli.submit("diagnose", "--quiet", NAN_BATCH, timeout=300)


@pytest.fixture(scope="module")
def cli_nan_batch(cli):
    res = prefetch(cli).result()
    return res, Run(res.out, res.stdout)


def test_cli_diagnose_lightning_script(cli_nan_batch):
    proc, run = cli_nan_batch
    assert proc.returncode == 1, proc.stderr
    # named by the user's variable (model = Model(...)), not by Lightning's pl_module local
    assert run.failure == (5, "data", "model", "input[0]")
    assert run.report["run"]["target"] == "bfloat16"
    assert run.report["run"]["target_source"] == "autocast"
    assert [s["index"] for s in run.report["steps"]] == list(range(6))
    _losses_match(run)


def test_an_exception_in_training_writes_a_crashed_report(tmp_path):
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from nanhunt.integrations.lightning import NanhuntCallback

    class Breaks(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("broken batch")
            x, y = batch
            return nn.functional.mse_loss(self.fc(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = NanhuntCallback(out=tmp_path / "r", quiet=True)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, callbacks=[cb],
                        enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
    with pytest.raises(RuntimeError, match="broken batch"):
        trainer.fit(Breaks(), data)
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["run"]["status"] == "crashed"
    assert "broken batch" in rep["run"]["error"]
    assert [s["index"] for s in rep["steps"]][:2] == [0, 1]
    assert rep["run"]["target_source"] == "default"  # 32-true: nothing in low precision


@pytest.mark.slow
def test_ddp_two_ranks_rank_1_named_both_stop(tmp_path):
    """Lightning DDP on CPU (gloo, 2 processes): only rank 1's data has the NaN sample."""
    import subprocess

    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, str(NAN_BATCH), "--devices", "2", "--callback",
                           str(out)], capture_output=True, text=True, timeout=400,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"batch (\d+) global_step (\d+) loss (\S+) rank (\d)", proc.stdout)
    nan_rank = {int(r) for _, _, loss, r in lines if loss == "nan"}
    assert nan_rank == {1}
    # both ranks stopped after the same step (nanhunt's vote), through trainer.should_stop
    assert proc.stdout.count("done global_step 6") == 2
    rep = json.loads((out / "report.json").read_text())
    f = rep["first_failure"]
    assert (f["step"], f["phase"], f["rank"], f["module"]) == (5, "data", 1, "Model")
    assert rep["run"]["world_size"] == 2
    assert [(r["rank"], len(r["steps"])) for r in rep["ranks"]] == [(0, 6), (1, 6)]
    assert (out / "ranks" / "rank-1.json").exists()
