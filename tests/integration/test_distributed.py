"""Distributed runs: the merge on hand-built traces, the step-end vote on an in-memory store, and
real two-process DDP runs (gloo, CPU) under torchrun and ``nanhunt diagnose --nproc-per-node``."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from nanhunt.cli.launch import torchrun_command
from nanhunt.distributed import (
    RankContext,
    RankResult,
    _parse_payload,
    _payload,
    merge_rank_files,
    merge_traces,
    rank_file,
)
from nanhunt.errors import NanhuntError
from nanhunt.report.files import atomic_write_text
from nanhunt.trace import Failure, Finding, RunInfo, StepRecord, TensorStats, Trace

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
HARD_TIMEOUT = 120  # seconds: a hang fails the test instead of the CI job
EXPERIMENTS_TIMEOUT = 420  # ... for a job whose report waits for its re-runs (all -m slow)


# ----------------------------------------------------------------------------- hand-built traces


def _failure(step: int, phase: str, module: str = "fc", tensor: str = "output") -> Failure:
    return Failure(
        step=step,
        phase=phase,
        module=module,
        tensor=tensor,
        stats=TensorStats(dtype="float16", shape=[2], numel=2, nan=1),
    )


def _trace(
    failure: Failure | None = None,
    *,
    steps: int = 3,
    status: str = "stopped",
    error: str | None = None,
    snapshot: str | None = None,
) -> Trace:
    trace = Trace(
        run=RunInfo(status=status, error=error),
        first_failure=failure,
        problem=failure is not None,
        snapshot=snapshot,
        steps=[StepRecord(index=i) for i in range(steps)],
    )
    if failure is not None:
        trace.diagnosis = Finding(
            rule="r", kind="overflow", severity="error", message="m", evidence=["own evidence"]
        )
    return trace


def test_origin_is_the_rank_that_failed_first_by_step_then_phase():
    results = [
        RankResult(0, _trace(_failure(2, "optimizer"))),
        RankResult(1, _trace(_failure(2, "data", "model", "input[0]"), snapshot="rank-1/s.pt")),
        RankResult(2, _trace(_failure(3, "data"))),
    ]
    merged = merge_traces(results, 3)
    assert merged.first_failure.rank == 1
    assert (merged.first_failure.step, merged.first_failure.phase) == (2, "data")
    assert merged.run.world_size == 3
    assert merged.snapshot == "ranks/rank-1/s.pt"  # the origin's, relative to the merged report
    origin_line = merged.diagnosis.evidence[0]
    assert origin_line.startswith("rank 1 of 3 saw a non-finite value first (step 2, data)")
    assert "rank 0 first at step 2, optimizer" in origin_line
    assert merged.diagnosis.evidence[1] == "own evidence"
    assert [(r.rank, r.answered, r.first_failure.rank) for r in merged.ranks] == [
        (0, True, 0),
        (1, True, 1),
        (2, True, 2),
    ]


def test_every_rank_failing_alike_is_said():
    results = [RankResult(r, _trace(_failure(3, "forward"))) for r in range(2)]
    merged = merge_traces(results, 2)
    assert merged.first_failure.rank == 0
    assert "every rank (2 of 2) failed alike" in merged.first_failure.detail.lower()
    assert merged.diagnosis.evidence[0].startswith("every rank (2 of 2) failed alike")


def test_a_tie_at_different_places_names_the_lowest_rank():
    results = [
        RankResult(1, _trace(_failure(3, "forward", "a"))),
        RankResult(0, _trace(_failure(3, "forward", "b"))),
    ]
    merged = merge_traces(results, 2)
    assert merged.first_failure.rank == 0
    assert "ranks 0, 1 failed in the same step and phase" in merged.diagnosis.evidence[0]


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_tie_goes_to_the_rank_whose_failure_the_step_reached_first(phase):
    """Tensor parallelism: rank 1's shard of layer ``2`` overflowed, rank 0 saw the inf only
    in the model's output after the all-reduce. In forward the module that completed first
    (``2`` before ``model``) is the origin; in backward the gradients flow the other way."""
    from nanhunt.trace import LayerStats

    def trace(module: str) -> Trace:
        t = _trace(_failure(3, phase, module))
        t.layers = [LayerStats(module=m, type="T") for m in ("0", "2", "3", "model")]
        return t

    merged = merge_traces([RankResult(0, trace("model")), RankResult(1, trace("2"))], 2)
    if phase == "forward":
        assert merged.first_failure.rank == 1 and merged.first_failure.module == "2"
        assert "rank 1's, at 2, came first in the step (rank 0 at model after it)" in \
            merged.diagnosis.evidence[0]
    else:
        assert merged.first_failure.rank == 0 and merged.first_failure.module == "model"


def test_no_failure_anywhere_keeps_rank_0():
    merged = merge_traces([RankResult(1, _trace(steps=5)), RankResult(0, _trace(steps=4))], 2)
    assert merged.first_failure is None
    assert len(merged.steps) == 4
    assert [len(r.steps) for r in merged.ranks] == [4, 5]


def test_missing_ranks_are_named_and_the_run_is_not_called_complete():
    merged = merge_traces(
        [RankResult(0, _trace(status="complete"))], 3, missing_reason="within 5 s"
    )
    assert [(r.rank, r.answered) for r in merged.ranks] == [(0, True), (1, False), (2, False)]
    assert merged.run.status == "crashed"
    assert any(n.startswith("ranks 1, 2 did not answer within 5 s") for n in merged.notes)


def test_the_first_rank_to_crash_explains_the_run():
    results = [
        RankResult(
            0, _trace(status="crashed", error="RuntimeError: Connection closed by peer"), ended=20.0
        ),
        RankResult(1, _trace(status="crashed", error="RuntimeError: planted"), ended=10.0),
        RankResult(2, _trace(status="complete", steps=1), ended=5.0),
    ]
    merged = merge_traces(results, 3)
    assert merged.run.status == "crashed"
    assert merged.run.error == "rank 1: RuntimeError: planted"
    assert "rank 1 raised: RuntimeError: planted" in merged.notes
    assert "rank 0 raised later: RuntimeError: Connection closed by peer" in merged.notes
    assert "rank 2's script ended (complete) after 1 steps, before rank 1 raised" in merged.notes


def test_merging_nothing_is_an_error():
    with pytest.raises(NanhuntError):
        merge_traces([], 2)


def test_rank_files_round_trip_and_stale_files_are_ignored(tmp_path):
    res = RankResult(1, _trace(_failure(2, "data")), ended=1.5, run_id="abc")
    path = rank_file(tmp_path, 1)
    path.parent.mkdir(parents=True)
    atomic_write_text(path, _payload(res, 2))
    back = _parse_payload(path.read_text())
    assert (back.rank, back.ended, back.run_id) == (1, 1.5, "abc")
    assert back.trace.first_failure.phase == "data"
    assert Trace.from_json(path.read_text()).first_failure.step == 2  # `nanhunt report` reads it
    merged = merge_rank_files(tmp_path, 2)
    assert [(r.rank, r.answered) for r in merged.ranks] == [(0, False), (1, True)]
    assert merge_rank_files(tmp_path, 2, newer_than=time.time() + 60) is None


def test_rank_context_from_env(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "NANHUNT_RANK_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    assert not RankContext.from_env().distributed
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("NANHUNT_RANK_TIMEOUT", "7")
    stale = rank_file(tmp_path, 1)
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    ctx = RankContext.from_env(tmp_path)
    assert (ctx.rank, ctx.world_size, ctx.timeout) == (1, 2, 7.0)
    assert not stale.exists()  # a stale file from an earlier run must not be merged
    monkeypatch.setenv("NANHUNT_RANK_TIMEOUT", "soon")
    with pytest.raises(NanhuntError, match="NANHUNT_RANK_TIMEOUT"):
        RankContext.from_env()
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(NanhuntError, match="not within WORLD_SIZE"):
        RankContext.from_env()


def test_torchrun_command_keeps_the_scripts_own_options():
    cmd = torchrun_command(2, ["--out", "o", "--nproc-per-node=2", "t.py", "--nproc-per-node", "9"])
    assert cmd[:5] == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
    ]
    assert cmd[5:] == ["-m", "nanhunt", "diagnose", "--out", "o", "t.py", "--nproc-per-node", "9"]
    assert torchrun_command(3, ["--nproc-per-node", "3", "-m", "pkg.train", "x"])[-3:] == [
        "-m",
        "pkg.train",
        "x",
    ]
    assert torchrun_command(2, ["--", "-odd.py"])[-2:] == ["--", "-odd.py"]


def test_exit_codes_keep_torchrun_from_cutting_rank_0_short(monkeypatch):
    monkeypatch.delenv("NANHUNT_LAUNCHER", raising=False)
    found = _trace(_failure(2, "data"))
    crashed = _trace(_failure(2, "data"), status="crashed")
    merged = merge_traces([RankResult(0, found), RankResult(1, found)], 2)
    rank0, rank1 = RankContext(rank=0, world_size=2), RankContext(rank=1, world_size=2)
    assert rank1.exit_code(1, found) == 0  # reported, stopped with the others
    assert rank1.exit_code(1, crashed) == 1  # crashed: torchrun must release its peers
    assert rank1.exit_code(3, crashed) == 3
    assert rank0.exit_code(1, merged) == 1  # bare torchrun: rank 0 carries the merged result
    monkeypatch.setenv("NANHUNT_LAUNCHER", "1")
    assert rank0.exit_code(1, merged) == 0  # the launcher reads it from report.json
    assert RankContext().exit_code(1, found) == 1


# ----------------------------------------------------------------------------- the step-end vote


class _Store:
    """The part of c10d's Store the vote uses, in memory and thread-safe."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.data[key] = value

    def add(self, key, n):
        with self.lock:
            value = int(self.data.get(key, b"0")) + n
            self.data[key] = str(value).encode()
            return value

    def check(self, keys):
        with self.lock:
            return all(k in self.data for k in keys)

    def delete_key(self, key):
        with self.lock:
            return self.data.pop(key, None) is not None


class _Hunt:
    def __init__(self, failing: bool = False) -> None:
        self.stop_on_problem = True
        self.first_failure = object() if failing else None
        self.stopped = False

    def request_stop(self) -> None:
        self.stopped = True


def _contexts(store: _Store, n: int, timeout: float = 10.0) -> list[RankContext]:
    return [RankContext(rank=r, world_size=n, timeout=timeout, _store=store) for r in range(n)]


def _vote_all(ctxs, hunts, step):
    threads = [threading.Thread(target=c._vote, args=(step, h)) for c, h in zip(ctxs, hunts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)


def test_one_rank_failing_stops_every_rank_at_that_step():
    store = _Store()
    ctxs = _contexts(store, 3)
    hunts = [_Hunt(), _Hunt(), _Hunt()]
    for step in range(3):
        _vote_all(ctxs, hunts, step)
    assert not any(h.stopped for h in hunts)
    assert "v0/0" not in store.data  # votes two steps back are cleaned up
    hunts[2].first_failure = object()
    _vote_all(ctxs, hunts, 3)
    assert all(h.stopped for h in hunts)


def test_a_rank_that_left_releases_its_peers_at_once():
    store = _Store()
    ctx0, ctx1 = _contexts(store, 2)
    ctx1.leave()  # raised before its first step end
    hunt = _Hunt()
    start = time.monotonic()
    ctx0._vote(0, hunt)
    assert hunt.stopped
    assert time.monotonic() - start < 2


def test_a_silent_rank_times_out_and_is_named():
    store = _Store()
    ctx0, _ = _contexts(store, 2, timeout=0.2)
    hunt = _Hunt()
    ctx0._vote(0, hunt)
    assert hunt.stopped
    assert ctx0.notes
    assert "rank 1 did not answer" in ctx0.notes[0]
    hunt2 = _Hunt()
    ctx0._vote(1, hunt2)  # gave up: no second wait
    assert not hunt2.stopped


def test_keep_going_runs_do_not_vote():
    store = _Store()
    ctx0, _ = _contexts(store, 2, timeout=0.2)
    hunt = _Hunt()
    hunt.stop_on_problem = False
    ctx0._vote(0, hunt)
    assert not store.data
    assert not hunt.stopped


# ----------------------------------------------------------------------------- real runs


def _run(cmd: list[str], cwd: Path, timeout: float = HARD_TIMEOUT,
         ) -> subprocess.CompletedProcess:
    """``cmd`` in a process group of its own, killed whole if it outlives ``timeout`` (a hung
    worker must not outlive the test; a job with its experiments gets EXPERIMENTS_TIMEOUT)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", NANHUNT_RANK_TIMEOUT="30", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # pragma: no cover - the failure being tested
        os.killpg(proc.pid, signal.SIGKILL)
        _out, err = proc.communicate()
        pytest.fail(f"hung: {cmd} did not finish in {timeout} s\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _torchrun(*args: str) -> list[str]:
    """``torchrun -m nanhunt diagnose args``: without experiments unless ``--verify`` is given
    (rank 0 of such a job re-runs it for them, one two-rank job each)."""
    verify = [] if "--verify" in args else ["--verify", "0"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "nanhunt",
        "diagnose",
        *verify,
        *args,
    ]


def _nanhunt(*args: str) -> list[str]:
    """``nanhunt diagnose --nproc-per-node 2 args``: without experiments unless ``--verify`` is
    given (the launcher re-runs the job for them)."""
    verify = [] if "--verify" in args else ["--verify", "0"]
    return [sys.executable, "-m", "nanhunt", "diagnose", "--nproc-per-node", "2", *verify, *args]


def _report(path: Path) -> dict:
    return json.loads((path / "report.json").read_text())


def _ddp_nan_batch(launcher) -> list[str]:
    return launcher("--quiet", "--out", "out", str(EXAMPLES / "ddp_nan_batch.py"), "--nan-rank",
                    "1", "--nan-step", "2")


def _fsdp2(dtype: str) -> list[str]:
    return _torchrun("--quiet", "--out", "out", str(SCRIPTS / "fsdp2_overflow.py"),
                     "--param-dtype", dtype, "--plant")


def _fsdp1(*extra: str) -> list[str]:
    return _torchrun("--quiet", "--out", "out", str(SCRIPTS / "fsdp1_overflow.py"), "--plant",
                     *extra)


def _plain_torchrun(script: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", str(script), *args]


def _printed(stdout: str) -> dict[tuple[int, int], tuple[float, float]]:
    """``rank R step S loss X gnorm G`` lines -> {(rank, step): (loss, gnorm)}."""
    out = {}
    for line in stdout.splitlines():
        w = line.split()
        if w[:1] == ["rank"] and "gnorm" in w:
            out[(int(w[1]), int(w[3]))] = (float(w[5]), float(w[7]))
    return out


def prefetch(cli) -> dict:
    """The default suite's torchrun jobs, in the session's shared pool (tests/integration/
    conftest.py), each in a fresh folder: their three processes run beside the in-process
    tests instead of holding up this thread."""
    return {"ddp": cli.call(("torchrun", "ddp-nan-batch"),
                            lambda cwd: (cwd, _run(_ddp_nan_batch(_torchrun), cwd))),
            "fsdp2": cli.call(("torchrun", "fsdp2", "float16"),
                              lambda cwd: (cwd, _run(_fsdp2("float16"), cwd)))}


# one torchrun job of each kind stays in the default suite (DDP here, FSDP2 below); the rest of
# the multi-process tests run with `-m slow`
@pytest.mark.parametrize("launcher", [
    pytest.param(_torchrun, id="torchrun"),
    pytest.param(_nanhunt, id="nproc-per-node", marks=pytest.mark.slow)])
def test_a_nan_in_rank_1s_batch_names_rank_1(launcher, tmp_path, cli):
    if launcher is _torchrun:
        tmp_path, proc = prefetch(cli)["ddp"].result()
    else:
        proc = _run(_ddp_nan_batch(launcher), tmp_path)
    assert proc.returncode != 0
    if launcher is _nanhunt:
        assert proc.returncode == 1, proc.stderr
    report = _report(tmp_path / "out")
    ff = report["first_failure"]
    assert (ff["rank"], ff["step"], ff["phase"]) == (1, 2, "data"), proc.stderr
    assert report["run"]["world_size"] == 2
    ranks = report["ranks"]
    assert [(r["rank"], r["answered"]) for r in ranks] == [(0, True), (1, True)]
    assert ranks[0]["first_failure"] is None  # rank 0's own batches were clean
    assert [len(r["steps"]) for r in ranks] == [3, 3]  # both stopped after step 2
    assert "rank 1 of 2 saw a non-finite value first" in ff["detail"].lower()
    assert (tmp_path / "out" / "ranks" / "rank-0.json").exists()
    assert (tmp_path / "out" / "ranks" / "rank-1.json").exists()


@pytest.mark.slow
def test_an_overflow_on_every_rank_is_reported_for_all_ranks(tmp_path):
    proc = _run(_torchrun("--quiet", "--out", "out", str(EXAMPLES / "ddp_overflow.py")), tmp_path)
    assert proc.returncode != 0
    report = _report(tmp_path / "out")
    ff = report["first_failure"]
    assert (ff["step"], ff["phase"], ff["module"]) == (3, "forward", "encoder.blocks.1.ffn.wo")
    assert "every rank (2 of 2) failed alike" in ff["detail"].lower()
    for r in report["ranks"]:
        assert r["answered"]
        assert (r["first_failure"]["step"], r["first_failure"]["module"]) == (
            3,
            "encoder.blocks.1.ffn.wo",
        )


@pytest.mark.slow
def test_a_rank_that_raises_does_not_hang_the_run(tmp_path):
    proc = _run(
        _nanhunt(
            "--out",
            "out",
            str(EXAMPLES / "ddp_nan_batch.py"),
            "--nan-rank",
            "-1",
            "--raise-rank",
            "1",
            "--raise-step",
            "3",
        ),
        tmp_path,
    )
    assert proc.returncode == 3, proc.stderr
    assert "planted failure at step 3" in proc.stderr  # the user's traceback, as Python prints it
    report = _report(tmp_path / "out")
    assert report["run"]["status"] == "crashed"
    assert report["run"]["error"] == "rank 1: RuntimeError: rank 1: planted failure at step 3"
    assert [r["answered"] for r in report["ranks"]] == [True, True]
    assert "rank 1 raised: RuntimeError: rank 1: planted failure at step 3" in report["notes"]


KILLED = textwrap.dedent("""
    import os, signal
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)   # the OOM killer, say
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
""")


@pytest.mark.slow
def test_a_killed_rank_is_named_as_not_answering(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    proc = _run(_torchrun("--quiet", "--out", "out", str(script)), tmp_path)
    assert proc.returncode != 0
    report = _report(tmp_path / "out")
    assert [(r["rank"], r["answered"]) for r in report["ranks"]] == [(0, True), (1, False)]
    assert report["run"]["status"] == "crashed"
    assert any(n.startswith("rank 1 did not answer") for n in report["notes"]), report["notes"]




@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_fsdp2_mixed_precision_overflow_on_one_rank_names_the_layer_and_rank(tmp_path, dtype,
                                                                            cli):
    """FSDP2 with MixedPrecisionPolicy(param_dtype=...): statistics on the local shards (no
    DTensor op) reduced across the ranks (against torch's full_tensor() in the script), module
    names as the user wrote them, the overflowing layer on rank 1, float32 advice as a change
    of the policy."""
    if dtype == "float16":
        tmp_path, proc = prefetch(cli)["fsdp2"].result()
        out, stdout = tmp_path / "out", proc.stdout
    else:
        proc = _run(_fsdp2(dtype), tmp_path)
        out, stdout = tmp_path / "out", proc.stdout
    assert "internal error" not in proc.stderr, proc.stderr
    report = _report(out)
    ff = report["first_failure"]
    assert (ff["rank"], ff["step"], ff["phase"], ff["module"], ff["tensor"]) == (
        1, 2, "forward", "2", "output"), proc.stderr
    assert ff["stats"]["dtype"] == dtype  # the policy's compute dtype
    assert ff["stats"]["posinf"] + ff["stats"]["neginf"] > 0
    assert 0 < ff["inputs"][0]["amax"] < 10  # a finite, modest input: the layer made it
    assert report["diagnosis"]["kind"] == "overflow"
    modules = {layer["module"] for layer in report["layers"]}
    assert {"0", "2", "3"} <= modules  # unsharded names, no FSDP prefix
    assert [(r["rank"], r["answered"], len(r["steps"])) for r in report["ranks"]] == [
        (0, True, 3), (1, True, 3)]
    # the whole gradients' statistics on every rank, though each rank summarised its shard
    printed = {}
    for line in stdout.splitlines():
        words = line.split()
        if words[:1] == ["rank"]:
            printed[(int(words[1]), int(words[3]))] = (float(words[7]), float(words[9]))
    for r in (0, 1):
        own = json.loads((out / "ranks" / f"rank-{r}.json").read_text())
        layer0 = next(layer for layer in own["layers"] if layer["module"] == "0")
        for step in (0, 1):
            gnorm, amax0 = printed[(r, step)]
            assert layer0["param_grad_amax_by_step"][str(step)] == amax0
            assert report["ranks"][r]["steps"][step]["grad_norm"] == pytest.approx(gnorm,
                                                                                   rel=1e-6)
    assert report["run"]["fsdp_policies"]["0"] == {
        "param_dtype": dtype, "reduce_dtype": "float32", "output_dtype": None}
    advice = next(r for r in report["recommendations"] if r["type"] == "fsdp_policy")
    assert advice["fix"] == [] and advice["code_change"]
    assert 'fully_shard(model.get_submodule("2"), mp_policy=fp32)' in advice["snippet"]
    assert "autocast" not in advice["snippet"]


@pytest.mark.slow  # (two 2-rank jobs: the default suite keeps one DDP and one FSDP2 job)
@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_fsdp1_mixed_precision_overflow_names_the_layer_rank_and_whole_gradient_norm(
        tmp_path, layout):
    """FSDP1 (FullyShardedDataParallel, MixedPrecision float16, a nested unit): the user's
    module names without FSDP1's ``_fsdp_wrapped_module``, the overflowing layer on rank 1,
    the gradient shards reduced across the ranks (the script's own all-reduced norm), each
    unit's MixedPrecision, and float32 advice as FSDP1 units of their own."""
    # flat: FSDP1's default flat parameters, where the unit owns its gradient shard
    proc = _run(_fsdp1("--nested", *(["--flat"] if layout == "flat" else [])), tmp_path)
    assert "internal error" not in proc.stderr, proc.stderr
    report = _report(tmp_path / "out")
    ff = report["first_failure"]
    assert (ff["rank"], ff["step"], ff["phase"], ff["module"], ff["tensor"]) == (
        1, 2, "forward", "2", "output"), proc.stderr
    assert ff["stats"]["dtype"] == "float16" and report["diagnosis"]["kind"] == "overflow"
    modules = {layer["module"] for layer in report["layers"]}
    assert {"0", "2", "3"} <= modules and not any("_fsdp" in m for m in modules), modules
    printed = _printed(proc.stdout)
    for r in (0, 1):
        for step in (0, 1):
            got = report["ranks"][r]["steps"][step]["grad_norm"]
            assert got == pytest.approx(printed[(r, step)][1], rel=1e-6)
    grads = {layer["module"]: layer["param_grad_amax_by_step"] for layer in report["layers"]}
    owner = "3" if layout == "flat" else "0"  # flat: each unit owns its shard
    assert grads[owner].get("0", 0) > 0, grads
    policies = report["run"]["fsdp_policies"]
    assert policies["3"] == policies[""] == {"param_dtype": "float16", "reduce_dtype": "float32",
                                             "output_dtype": None, "api": "FSDP1"}
    advice = next(r for r in report["recommendations"] if r["type"] == "fsdp_policy")
    assert advice["code_change"] and "FSDP1 unit <root>" in " ".join(advice["evidence"])
    assert 'FSDP(model.get_submodule("2"), mixed_precision=fp32)' in advice["snippet"]
    assert "autocast" not in advice["snippet"] and "fully_shard" not in advice["snippet"]


@pytest.mark.slow
def test_the_fsdp1_float32_unit_snippet_is_the_hand_written_unit(tmp_path):
    """The advice's code for layer ``3``, pasted into a copy of the script before its
    FSDP(model, ...), trains exactly as the script's own hand-written float32 unit does
    (--fp32-unit 3), and differs from the float16 run."""
    from nanhunt.analyse.advise import _fsdp1_fp32
    from nanhunt.trace import Recommendation

    rec = _fsdp1_fp32(Recommendation(type="fp32_module", value="3", snippet="", module="3",
                                     evidence=["e"]), ["3"], "", "float16")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_fixes import paste

    script = SCRIPTS / "fsdp1_overflow.py"
    code = rec.snippet.replace("mixed_precision=fp32)",  # as the comment says
                               "mixed_precision=fp32, device_id=cpu, "
                               "use_orig_params=not args.flat)")
    copy = tmp_path / "fsdp1_pasted.py"
    copy.write_text(paste(script.read_text(), code, after='cpu = torch.device("cpu")'))
    pasted = _printed(_run(_plain_torchrun(copy), tmp_path).stdout)
    by_hand = _printed(_run(_plain_torchrun(script, "--fp32-unit", "3"), tmp_path).stdout)
    half = _printed(_run(_plain_torchrun(script), tmp_path).stdout)
    assert len(pasted) == 8 and pasted == by_hand
    assert pasted != half


@pytest.mark.slow
def test_tensor_parallel_overflow_names_the_shard_that_made_it_and_the_whole_norm(tmp_path):
    """parallelize_module (column- then row-parallel linears, float16 autocast): the layer
    whose shard overflowed on rank 1 is the origin (rank 0 saw the inf only after the
    row-parallel all-reduce), the gradient norm counts each shard once and a replicated bias
    once (the script's own full_tensor() norm), and the sharded model is not replayed on one
    rank (said, not raised)."""
    proc = _run(_torchrun("--quiet", "--out", "out", str(SCRIPTS / "tp_overflow.py"),
                          "--plant"), tmp_path)
    assert "internal error" not in proc.stderr, proc.stderr
    report = _report(tmp_path / "out")
    ff = report["first_failure"]
    assert (ff["rank"], ff["step"], ff["phase"], ff["module"], ff["op"]) == (
        1, 2, "forward", "2", "aten.mul"), proc.stderr
    assert report["diagnosis"]["kind"] == "overflow"
    printed = _printed(proc.stdout)
    for r in (0, 1):
        for step in (0, 1):
            got = report["ranks"][r]["steps"][step]["grad_norm"]
            assert got == pytest.approx(printed[(r, step)][1], rel=1e-6)
    assert not any("raised" in n for n in report["notes"]), report["notes"]
    assert any("cannot replay it alone" in n for n in report["notes"]), report["notes"]


@pytest.mark.slow
def test_no_sync_micro_batches_belong_to_their_step(tmp_path):
    """Gradient accumulation under DDP's no_sync: three forward/backward passes per optimizer
    step are one step; a NaN in rank 1's first (unsynchronised) micro-batch of step 2 is step 2."""
    proc = _run(_torchrun("--quiet", "--out", "out", str(SCRIPTS / "ddp_no_sync.py")), tmp_path)
    report = _report(tmp_path / "out")
    ff = report["first_failure"]
    assert (ff["rank"], ff["step"], ff["phase"], ff["tensor"]) == (1, 2, "data", "input[0]"), \
        proc.stderr
    assert [(r["rank"], len(r["steps"])) for r in report["ranks"]] == [(0, 3), (1, 3)]
    assert report["ranks"][1]["first_failure"]["step"] == 2


@pytest.mark.slow  # (eight re-runs of a two-rank job: about 90 s on 2 CPUs)
def test_a_compression_hook_that_overflows_is_found_in_the_communication_phase(tmp_path):
    """fp16_compress_hook overflows the all-reduced gradients at step 2 on every rank, from
    finite float32 gradients: the communication phase, the hook named, comm-hook:none offered
    (bf16_compress_hook is refused by DDP on gloo). Under ``torchrun -m nanhunt`` (a launcher
    that is not nanhunt's), rank 0 re-runs the job under a torchrun of its own for the
    experiments: the control recurs, float32 everywhere trains, float32 in the model's modules
    alone does not (the hook still compresses), and the no-compression fix is verified."""
    proc = _run(_torchrun("--quiet", "--verify", "4", "--out", "out",
                          str(SCRIPTS / "ddp_comm_hook.py")), tmp_path, EXPERIMENTS_TIMEOUT)
    report = _report(tmp_path / "out")
    ff = report["first_failure"]
    assert (ff["step"], ff["phase"], ff["module"], ff["tensor"]) == (
        2, "communication", "0", "0.weight.grad"), proc.stderr
    assert ff["reduction"] == "DDP all-reduce through fp16_compress_hook"
    assert ff["reduce_dtype"] == "float16"
    local = ff["local_grad"]
    assert local["nan"] + local["posinf"] + local["neginf"] == 0 and local["amax"] > 65504
    assert report["all_ranks_failed"]
    assert report["run"]["comm_hooks"] == ["fp16_compress_hook"]
    d = report["diagnosis"]
    assert (d["rule"], d["phase"]) == ("reduction-overflow", "communication")
    assert "fp16_compress_hook" in d["message"]
    fixes = {r["type"]: r["fix"] for r in report["recommendations"]}
    assert fixes["no_comm_hook"] == ["comm-hook:none"] and "comm_hook" not in fixes
    assert [(r["rank"], r["answered"], len(r["steps"])) for r in report["ranks"]] == [
        (0, True, 3), (1, True, 3)]
    ex = report["experiments"]
    by = {e["rung"]: e for e in ex["runs"]}
    assert ex["source"] == "experiments" and ex["control_reproduced"] is True
    assert (by["control"]["outcome"], by["fp32"]["outcome"]) == ("recurred", "trained")
    assert ex["verdict"] == "precision"
    regions = [e for e in ex["runs"] if e["rung"] == "region"]
    assert regions and all(e["outcome"] == "recurred" for e in regions)
    rec = next(r for r in report["recommendations"] if r["type"] == "no_comm_hook")
    assert rec["verified"], rec
    # each re-run was the whole job under torchrun: both ranks in its merged report
    control = _report(tmp_path / "out" / by["control"]["report"].rsplit("/", 1)[0])
    assert control["run"]["world_size"] == 2 and len(control["ranks"]) == 2
    assert proc.returncode == 1, proc.stderr


@pytest.mark.slow
def test_the_comm_hook_fix_under_torchrun_trains_quietly(tmp_path):
    """The same script with --fix comm-hook:none (the healthy twin: DDP's own float32
    all-reduce), every step of every rank finite, nothing reported."""
    proc = _run(_torchrun("--quiet", "--out", "out", "--fix", "comm-hook:none",
                          str(SCRIPTS / "ddp_comm_hook.py")), tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = _report(tmp_path / "out")
    assert report["first_failure"] is None and report["diagnosis"] is None
    assert not report["problem"]
    assert not any(w["rule"] == "reduction-overflow" for w in report["warnings"])
    assert report["run"]["comm_hooks"] == [] and report["run"]["fixes"] == ["comm-hook:none"]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines()
              if line.startswith("rank ")]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)


@pytest.mark.slow  # (two torchrun jobs; the pieces are unit tests: tests/unit/test_locate.py)
def test_the_sentinel_on_a_sharded_model_names_the_layer_by_a_locating_rerun(tmp_path):
    """FSDP2 under --mode sentinel: no rank can replay the failing step alone (the weights are
    split across the ranks), so the launcher re-runs the job with full tracing up to that step,
    its output and files kept out of the user's, and the report takes the layer, rank and cause
    that re-run found at the same step (the layer the script planted the overflow in), labelled
    as located by the re-run; one summary on the terminal."""
    proc = _run(_nanhunt("--mode", "sentinel", "--verify", "0", "--out", "out",
                         str(SCRIPTS / "fsdp2_overflow.py"), "--plant"), tmp_path)
    assert proc.returncode == 1, proc.stderr
    report = _report(tmp_path / "out")
    assert report["run"]["mode"] == "sentinel"
    ff = report["first_failure"]
    assert (ff["rank"], ff["step"], ff["phase"], ff["module"], ff["tensor"]) == (
        1, 2, "forward", "2", "output"), proc.stderr
    assert ff["observed"] is True and "located by a full-tracing re-run" in ff["detail"]
    assert report["diagnosis"]["kind"] == "overflow"
    assert any("names the origin: step 2 / forward / 2 / output" in n for n in report["notes"])
    located = _report(tmp_path / "out" / "locate")
    assert located["run"]["mode"] == "full" and located["first_failure"]["module"] == "2"
    # the re-run's printed lines went to its own log, not to the user's stdout: one run's lines
    assert proc.stdout.count("rank 1 step 1 loss") == 1
    assert "rank 1 step 1 loss" in (tmp_path / "out" / "locate" / "output.txt").read_text()
    assert proc.stderr.count("PROBLEM:") == 1 and "re-running steps 0-2" in proc.stderr


@pytest.mark.slow
def test_the_sentinel_under_a_torchrun_of_the_users_names_the_layer_by_a_locating_rerun(
        tmp_path):
    """``torchrun -m nanhunt diagnose --mode sentinel`` on FSDP2: rank 0 (every rank on this
    machine) locates the step no rank could replay by a full-tracing re-run under a torchrun of
    its own, as nanhunt's launcher does, and the report takes the layer it names."""
    proc = _run(_torchrun("--mode", "sentinel", "--out", "out",
                          str(SCRIPTS / "fsdp2_overflow.py"), "--plant"), tmp_path)
    assert proc.returncode == 1, proc.stderr
    report = _report(tmp_path / "out")
    ff = report["first_failure"]
    assert (ff["rank"], ff["step"], ff["phase"], ff["module"], ff["tensor"]) == (
        1, 2, "forward", "2", "output"), proc.stderr
    assert ff["observed"] is True and "located by a full-tracing re-run" in ff["detail"]
    assert report["diagnosis"]["kind"] == "overflow"
    located = _report(tmp_path / "out" / "locate")
    assert located["run"]["mode"] == "full" and located["run"]["world_size"] == 2
    assert proc.stdout.count("rank 1 step 1 loss") == 1  # the re-run's lines went to its log
    assert proc.stderr.count("PROBLEM:") == 1 and "re-running steps 0-2" in proc.stderr


@pytest.mark.slow  # (seven re-runs of a two-rank job: about a minute on 2 CPUs)
def test_a_torchrun_job_gets_its_experiments_as_torchrun_reruns(tmp_path):
    """nanhunt diagnose --nproc-per-node 2 re-runs the job under torchrun for each experiment:
    a NaN in one sample of rank 1's batch at step 2 recurs in the control, in float32 and at
    lower learning rates, and goes with that sample replaced; the data fix is verified by that
    re-run, and the terminal shows one summary, after the experiments."""
    proc = _run(_nanhunt("--out", "out", "--verify", "4", str(EXAMPLES / "ddp_nan_batch.py"),
                         "--nan-rank", "1", "--nan-step", "2"), tmp_path, EXPERIMENTS_TIMEOUT)
    assert proc.returncode == 1, proc.stderr
    report = _report(tmp_path / "out")
    ex = report["experiments"]
    by = {e["rung"]: e for e in ex["runs"]}
    assert ex["source"] == "experiments" and ex["control_reproduced"] is True
    assert by["control"]["outcome"] == by["fp32"]["outcome"] == "recurred"
    assert by["skip-samples"]["outcome"] == "trained" and ex["verdict"] == "data"
    rec = next(r for r in report["recommendations"] if r["type"] == "fix_data")
    assert rec["verified"] and rec["fix"] == [by["skip-samples"]["fixes"][0]]
    # each experiment was the job under torchrun: its merged report names both ranks
    control = _report(tmp_path / "out" / by["control"]["report"].rsplit("/", 1)[0])
    assert control["run"]["world_size"] == 2 and len(control["ranks"]) == 2
    assert proc.stderr.count("PROBLEM:") == 1
    assert proc.stderr.index("experiment control") < proc.stderr.index("PROBLEM:")


@pytest.mark.slow
def test_the_sentinel_in_a_sharded_script_reports_each_rank_and_the_command_that_names_the_layer(
        tmp_path):
    """``nanhunt.sentinel`` inside an FSDP2 script under a plain torchrun: each rank reports in a
    folder of its own (before, both wrote the same files), with its rank, and the step it could
    not replay comes with the command that names the layer; that command, run as given (the
    script's own sentinel stands aside under it), names layer 2 on rank 1."""
    import shlex

    script = SCRIPTS / "fsdp2_overflow.py"
    proc = _run(_plain_torchrun(script, "--plant", "--sentinel", "sent"), tmp_path)
    assert proc.returncode == 0, proc.stderr  # the sentinel reports; the script trains on
    reports = {r: _report(tmp_path / "sent" / "ranks" / f"rank-{r}") for r in (0, 1)}
    for r, report in reports.items():
        ff = report["first_failure"]
        assert (ff["rank"], ff["step"], ff["observed"]) == (r, 2, False)
        assert report["run"]["world_size"] == 2
        assert f"nanhunt sentinel (rank {r} of 2): first non-finite value at step 2" in \
            proc.stderr
    hint = next(n for n in reports[1]["notes"] if n.startswith("to name the layer"))
    command = shlex.split(hint.split(": ", 1)[1])
    assert command[:2] == ["nanhunt", "diagnose"] and "--max-steps" in command
    located = _run([sys.executable, "-m", "nanhunt", *command[1:]], tmp_path)
    assert located.returncode == 1, located.stderr
    report = _report(tmp_path / "nanhunt-report")
    ff = report["first_failure"]
    assert (ff["rank"], ff["step"], ff["phase"], ff["module"], ff["tensor"]) == (
        1, 2, "forward", "2", "output")
    assert any("stood aside" in n for n in report["notes"])


@pytest.mark.slow
def test_stopping_the_users_torchrun_during_rank_0s_reruns_keeps_the_report(tmp_path):
    """Ctrl-C at the user's torchrun while rank 0 re-runs the job: torchrun SIGTERMs rank 0,
    which stops its re-runs as Ctrl-C does and writes the report (with what it found) well
    within the 30 s torchrun gives it before SIGKILL."""
    cmd = _torchrun("--out", "out", "--verify", "4", str(EXAMPLES / "ddp_nan_batch.py"),
                    "--nan-rank", "1", "--nan-step", "2")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", NANHUNT_RANK_TIMEOUT="30"))
    try:
        deadline = time.monotonic() + 150
        while not (tmp_path / "out" / "reruns" / "control").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no re-run started"
            time.sleep(0.2)
        time.sleep(2)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert took < 25, err  # before torchrun's SIGKILL (30 s after its SIGTERM)
    report = _report(tmp_path / "out")
    assert report["verification"]["interrupted"] is True
    assert "interrupted" in report["verification"]["note"]
    assert (report["first_failure"]["rank"], report["first_failure"]["step"]) == (1, 2)
