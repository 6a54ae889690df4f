"""The launcher's locating re-run (nanhunt.cli.launch): its command line and what it adopts."""

from __future__ import annotations

from pathlib import Path

from nanhunt.cli.launch import _locate_argv, adopt_located
from nanhunt.distributed import needs_locating
from nanhunt.trace import Failure, Finding, RunInfo, TensorStats, Trace


def _stats() -> TensorStats:
    return TensorStats(dtype="float16", shape=[2], numel=2, nan=1, amax=1.0)


def _sentinel_trace() -> Trace:
    f = Failure(step=3, phase="forward", module="", tensor="loss", stats=_stats(), rank=1,
                observed=False, detail="step 3 was not replayed: model is sharded by FSDP2: its "
                "weights are split across the ranks, so one rank cannot replay its step alone")
    return Trace(run=RunInfo(mode="sentinel"), first_failure=f, problem=True)


def test_the_rerun_is_the_same_job_traced_in_full_up_to_the_failing_step():
    argv = ["--nproc-per-node", "2", "--mode", "sentinel", "--out=r", "--fix", "bf16", "-q",
            "--quiet", "--verify", "2", "train.py", "--mode", "x", "--out", "y"]
    assert _locate_argv(argv, Path("/o/locate"), 3) == [
        "--fix", "bf16", "-q", "--mode", "full", "--out", "/o/locate", "--max-steps", "4",
        "--verify", "0", "--quiet", "--", "train.py", "--mode", "x", "--out", "y"]
    assert _locate_argv(["-m", "pkg.train", "--lr", "1"], Path("o"), 0)[-4:] == [
        "-m", "pkg.train", "--lr", "1"]


def test_only_an_unreplayed_sentinel_step_is_located():
    t = _sentinel_trace()
    assert needs_locating(t)
    t.first_failure.observed = True
    assert not needs_locating(t)
    t = _sentinel_trace()
    t.run.mode = "full"
    assert not needs_locating(t)
    t = _sentinel_trace()  # a copy refused over the memory cap: not a sharded model
    t.first_failure.detail = "step 3 was not replayed: the copy needs 5 GiB, over the cap"
    assert not needs_locating(t)


def test_a_rerun_that_fails_elsewhere_leaves_the_origin_unobserved_and_says_so():
    for located, said in [
            (None, "wrote no report (exit status 1)"),
            (Trace(), "found no failure"),
            (Trace(first_failure=Failure(step=5, phase="forward", module="a", tensor="output",
                                         stats=_stats())), "failed at step 5, not 3")]:
        t = _sentinel_trace()
        adopt_located(t, located, "exit status 1", 2)
        assert not t.first_failure.observed and t.first_failure.tensor == "loss"
        assert said in t.notes[-1] and "the origin stays unobserved" in t.notes[-1]
    t = _sentinel_trace()
    g = Failure(step=3, phase="forward", module="blocks.1", tensor="output", stats=_stats(),
                rank=1)
    found = Trace(first_failure=g, problem=True,
                  diagnosis=Finding(rule="forward-overflow", kind="overflow", severity="error",
                                    message="m"))
    adopt_located(t, found, "exit status 0", 2)
    assert t.first_failure.module == "blocks.1" and t.diagnosis.kind == "overflow"
    assert "located by a full-tracing re-run of steps 0-3" in t.first_failure.detail


def test_the_locating_rerun_is_sandboxed_but_analysed_in_full(tmp_path, monkeypatch):
    """NANHUNT_LOCATING=1 beside NANHUNT_RERUN=1: torch.save goes to the scratch folder, as in a
    verification re-run, but the run is not judged as one (its replay and every report form)."""
    import torch

    from nanhunt.experiment.fixes import RunFixes

    monkeypatch.setenv("NANHUNT_RERUN", "1")
    monkeypatch.setenv("NANHUNT_LOCATING", "1")
    monkeypatch.setenv("NANHUNT_SCRATCH", str(tmp_path / "scratch"))
    fixes = RunFixes([])
    assert fixes.rerun is False
    fixes.install()
    try:
        torch.save({"w": torch.ones(2)}, tmp_path / "ckpt.pt")
    finally:
        fixes.uninstall()
    assert not (tmp_path / "ckpt.pt").exists()
    assert list((tmp_path / "scratch").rglob("ckpt.pt"))


def test_who_re_runs_a_multi_process_job_and_in_what_environment(monkeypatch):
    """rank 0 of a one-machine torchrun job nanhunt did not launch re-runs it under a torchrun of
    its own, without this job's rendezvous; the parent of workers the script starts re-runs the
    script; a job on several machines and a job nanhunt's launcher re-runs are left as they are."""
    from nanhunt.distributed import RankContext
    from nanhunt.experiment.verify import RerunConfig

    torchrun_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GROUP_RANK": "0",
                    "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_ERROR_FILE": "/tmp/e.json",
                    "PET_NNODES": "1", "OMP_NUM_THREADS": "1", "PATH": "/bin"}
    for k, v in torchrun_env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("NANHUNT_LAUNCHER", raising=False)
    cfg = RerunConfig(script="t.py", module=None, args=[], cwd=".", env=dict(torchrun_env))
    from nanhunt.trace import RankSummary

    rank0 = RankContext(rank=0, world_size=2)
    both = Trace(ranks=[RankSummary(0, status="stopped"), RankSummary(1, status="stopped")])
    mine = rank0.job_reruns(cfg, both)
    assert (mine.nproc, mine.workers, mine.processes, mine.not_rerun) == (2, None, 2, None)
    assert mine.env == {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
    assert mine.stop_grace is not None and mine.stop_grace < 30  # torchrun's SIGKILL delay
    assert cfg.env == torchrun_env  # the run's own config is not changed
    # a rank that crashed: torchrun is stopping every rank, rank 0 with its re-runs
    crashed = Trace(ranks=[RankSummary(0, status="stopped"),
                           RankSummary(1, status="crashed", error="RuntimeError: x")])
    refused = rank0.job_reruns(cfg, crashed)
    assert refused.processes is None and refused.not_rerun.startswith("rank 1 crashed")
    silent = Trace(ranks=[RankSummary(0), RankSummary(1, answered=False, status="no answer")])
    assert "rank 1 did not answer" in rank0.job_reruns(cfg, silent).not_rerun
    rank0.terminated_at = 1.0  # torchrun's SIGTERM came while the report was made
    assert "SIGTERM" in rank0.job_reruns(cfg, both).not_rerun
    rank0.terminated_at = None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank per machine
    far = rank0.job_reruns(cfg, both)
    assert far.processes is None and "several machines" in far.not_rerun
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # srun, mpirun: not torchrun
    assert "not started by torchrun" in rank0.job_reruns(cfg, both).not_rerun
    monkeypatch.setenv("NANHUNT_LAUNCHER", "1")  # the launcher re-runs it
    assert rank0.job_reruns(cfg) is cfg
    parent = RankContext()
    parent.workers = (3, "id", 0.0)
    spawned = parent.job_reruns(cfg)
    assert (spawned.workers, spawned.nproc, spawned.processes) == (3, None, 3)
    assert RankContext().job_reruns(cfg) is cfg  # one process


def test_the_in_script_sentinels_command_fits_how_the_job_was_started(monkeypatch):
    """torchrun on one machine: --nproc-per-node; on several: torchrun's own launch with nanhunt;
    workers a script starts itself (no torchrun environment): the script alone, which starts
    them; a module run with -m stays one."""
    import shlex
    import sys
    import types

    from nanhunt.pipeline import locate_command

    t = _sentinel_trace()  # step 3
    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "1"])
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert shlex.split(locate_command(t, 2)) == [
        "nanhunt", "diagnose", "--nproc-per-node", "2", "--max-steps", "4", "--verify", "0",
        "train.py", "--lr", "1"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert locate_command(t, 2).startswith("torchrun [your job's options] -m nanhunt diagnose")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert shlex.split(locate_command(t, 2))[:4] == ["nanhunt", "diagnose", "--max-steps", "4"]
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="pkg.train")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["/src/pkg/train.py", "--lr", "1"])
    assert shlex.split(locate_command(t, 1))[-4:] == ["-m", "pkg.train", "--lr", "1"]
