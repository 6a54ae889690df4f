"""``nanhunt diagnose --nproc-per-node N``: the same run under torch.distributed's own launcher;
rank 0 merges the ranks' reports (:mod:`nanhunt.distributed`), and the launcher falls back to
merging the rank files itself when rank 0 wrote none.

Where the sentinel could not replay the failing step (a model sharded across the ranks: no rank
can replay its step alone), the launcher locates it by a re-run: the same job under torchrun,
traced in full, stopped after the failing step, its files redirected as a verification re-run's
(:mod:`nanhunt.experiment.sandbox`). Where that re-run fails at the same step, its origin (layer,
op, rank), diagnosis and recommendations are the report's, labelled so; otherwise the report
says what the re-run found instead."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nanhunt.cli.args import diagnose_parser, rerun_options, split_argv
from nanhunt.distributed import (
    _LAUNCHER_ENV,
    launcher_continues,
    merge_rank_files,
    needs_locating,
)
from nanhunt.errors import EXIT_INTERRUPTED, EXIT_PROBLEM, EXIT_SCRIPT_FAILED, NanhuntError
from nanhunt.trace import Trace

__all__ = ["LOCATE_DIR", "launch", "needs_locating", "torchrun_command"]

#: the locating re-run's folder, in the report's
LOCATE_DIR = "locate"


def _without_nproc(options: list[str]) -> list[str]:
    out, skip = [], False
    for tok in options:
        if skip:
            skip = False
        elif tok == "--nproc-per-node":
            skip = True
        elif not tok.startswith("--nproc-per-node="):
            out.append(tok)
    return out


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The torch.distributed launcher command that runs ``nanhunt diagnose argv`` on ``nproc``
    processes (``--nproc-per-node`` taken out of our options, the script's own left alone).

    >>> torchrun_command(2, ["--nproc-per-node", "2", "-q", "t.py", "--nproc-per-node", "1"])[2:]
    ['torch.distributed.run', '--standalone', '--nproc-per-node=2', '-m', 'nanhunt', 'diagnose', \
'-q', 't.py', '--nproc-per-node', '1']
    """
    ours, script, module, script_args = split_argv(argv)
    if module is not None:
        target = ["-m", module]
    else:  # a script named like an option needs the "--"
        target = ["--", str(script)] if str(script).startswith("-") else [str(script)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "nanhunt",
        "diagnose",
        *_without_nproc(ours),
        *target,
        *script_args,
    ]


def launch(nproc: int, argv: list[str]) -> int:
    """``nanhunt diagnose --nproc-per-node N ...``: the same run under torch.distributed's own
    launcher (``python -m torch.distributed.run --standalone``); the exit code follows the merged
    report that rank 0 writes."""

    opts = diagnose_parser().parse_args(split_argv(argv)[0])
    cmd = torchrun_command(nproc, argv)
    out_dir = Path(opts.out)
    started = time.time()
    interrupted = False
    proc = subprocess.Popen(cmd, env={**os.environ, _LAUNCHER_ENV: "1"})
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # torchrun got the SIGINT too and stops its workers
        interrupted = True
        try:
            rc = proc.wait(timeout=60)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait()
    trace = _read_report(out_dir / "report.json", newer_than=started - 1)
    rewrite = False
    if trace is None:
        trace = merge_rank_files(out_dir, nproc, newer_than=started - 1)
        if trace is None:
            print(f"nanhunt: the ranks wrote no report (torchrun exited {rc})", file=sys.stderr)
            return EXIT_INTERRUPTED if interrupted else (rc or EXIT_SCRIPT_FAILED)
        trace.notes.append("rank 0 wrote no merged report; the launcher merged the rank files")
        rewrite = True
    job_seconds = time.time() - started
    from nanhunt.pipeline import _guard  # (torch: only once the job ran)

    cut_short = False  # Ctrl-C during the re-runs after the job: exit 130, as a single process
    # (one process: rank 0 ran its experiments itself, as a single-process run does)
    if trace.run.world_size > 1 and _guard(trace, "deciding what follows the job",
                                           launcher_continues, trace, verify=opts.verify > 0):
        # rank 0 left the summary to this process: it is printed once, below, whatever happens
        rewrite = True
        if needs_locating(trace):
            if interrupted:
                trace.notes.append("the sentinel could not replay the failing step; the run "
                                   "was interrupted, so no locating re-run was started")
            elif locate_guarded(trace, lambda: locate(trace, nproc, argv, out_dir)):
                interrupted = cut_short = True
        if opts.verify > 0 and not interrupted:
            try:
                _experiments(trace, nproc, argv, opts, out_dir, job_seconds)
            except KeyboardInterrupt:
                cut_short = True
            except Exception as exc:  # the job's own report stands
                trace.notes.append(f"the experiments after the job failed "
                                   f"({type(exc).__name__}: {exc})")
            if trace.verification is not None and trace.verification.interrupted:
                cut_short = True
    if rewrite:
        try:
            _write_fallback(trace, out_dir, quiet=opts.quiet, show_all=opts.show_all)
        except Exception as exc:  # the merged report.json stands, as rank 0 wrote it
            print(f"nanhunt: writing the reports failed ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
    if cut_short:
        return EXIT_INTERRUPTED
    if trace.problem or (opts.strict and trace.warnings):
        return EXIT_PROBLEM
    if interrupted or trace.run.status == "interrupted":
        return EXIT_INTERRUPTED
    if trace.run.status == "crashed":
        return EXIT_SCRIPT_FAILED
    return rc


def _read_report(path: Path, *, newer_than: float) -> Trace | None:
    try:
        if path.stat().st_mtime < newer_than:
            return None
        return Trace.from_json(path.read_text(encoding="utf-8"))
    except (OSError, NanhuntError):
        return None


def _write_fallback(trace: Trace, out_dir: Path, *, quiet: bool, show_all: bool) -> None:
    from nanhunt.report import render_terminal, write_reports

    paths = write_reports(trace, out_dir)
    if not quiet:
        from rich.console import Console

        console = Console(stderr=True, highlight=False)
        render_terminal(trace, console, show_all=show_all)
        console.print("reports: " + ", ".join(str(p) for p in paths.values()), soft_wrap=True)


#: options the locating re-run sets itself
_OWN = {"--mode", "--out", "--max-steps", "--verify", "--nproc-per-node", "--sample-every",
        "--keep-steps", "--jobs", "--budget"}
_FLAGS = {"--quiet", "--keep-going", "--all", "--strict"}


def _locate_argv(argv: list[str], out: Path, step: int) -> list[str]:
    ours, script, module, rest = split_argv(argv)
    kept: list[str] = []
    i = 0
    while i < len(ours):
        tok = ours[i]
        name = tok.split("=", 1)[0]
        if name in _OWN:
            i += 1 if "=" in tok else 2
            continue
        if tok not in _FLAGS:
            kept.append(tok)
        i += 1
    kept += ["--mode", "full", "--out", str(out), "--max-steps", str(step + 1), "--verify", "0",
             "--quiet"]
    where = ["-m", module] if module else ["--", script] if script else []
    return kept + where + rest


def _experiments(trace: Trace, nproc: int, argv: list[str], opts: Any, out_dir: Path,
                 job_seconds: float) -> None:
    """The experiment ladder and the fix search for a torchrun job: each re-run is the job
    again under torchrun (:class:`~nanhunt.experiment.verify.RerunConfig` ``nproc``), one at a
    time, as a single-process run's are (:func:`nanhunt.experiment.verify.verify_by_rerun`)."""
    from nanhunt.experiment.verify import RerunConfig, verify_by_rerun

    _ours, script, module, args = split_argv(argv)
    cfg = RerunConfig(script=script, module=module, args=list(args), cwd=os.getcwd(),
                      env={**os.environ, _LAUNCHER_ENV: "1"}, tries=opts.verify,
                      max_steps=opts.max_steps, options=rerun_options(opts), quiet=opts.quiet,
                      jobs=1, budget=opts.budget, script_seconds=round(job_seconds, 2),
                      nproc=nproc)
    verify_by_rerun(trace, cfg, out_dir)


def locate(trace: Trace, nproc: int, argv: list[str], out_dir: Path, *,
           env: dict[str, str] | None = None, quiet: bool | None = None, cwd: str | None = None,
           spawned: bool = False) -> None:
    """Re-run the job in full tracing up to the step the sentinel could not replay, and adopt
    what it locates there (:func:`adopt_located`): under torchrun on ``nproc`` processes, or
    (``spawned``) as the script alone, which starts its workers itself. ``env``: the job's
    environment (default: this process's)."""
    f = trace.first_failure
    assert f is not None
    out = out_dir / LOCATE_DIR
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    if quiet is None:
        quiet = diagnose_parser().parse_args(split_argv(argv)[0]).quiet
    if not quiet:
        print(f"nanhunt: step {f.step} was not replayed on this sharded model; re-running steps "
              f"0-{f.step} with full tracing on {nproc} processes to name the layer",
              file=sys.stderr)
    largv = _locate_argv(list(argv), out.resolve(), f.step)
    cmd = ([sys.executable, "-m", "nanhunt", "diagnose", *largv] if spawned
           else torchrun_command(nproc, largv))
    env = {**(os.environ if env is None else env), _LAUNCHER_ENV: "1", "NANHUNT_RERUN": "1",
           "NANHUNT_LOCATING": "1", "WANDB_MODE": "disabled",
           "NANHUNT_SCRATCH": str((out / "files").resolve())}
    started = time.time()
    with open(out / "output.txt", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                stdin=subprocess.DEVNULL)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    located = _read_report(out / "report.json", newer_than=started - 1) or \
        merge_rank_files(out, nproc, newer_than=started - 1)
    adopt_located(trace, located, f"exit status {rc}", nproc, spawned=spawned)


def locate_guarded(trace: Trace, run: Any) -> bool:
    """``run()`` (a locating re-run); what went wrong becomes a note and the sentinel's report
    stands. True when Ctrl-C cut it short."""
    try:
        run()
    except KeyboardInterrupt:
        trace.notes.append("the locating re-run was interrupted (Ctrl-C)")
        return True
    except Exception as exc:  # the sentinel's report stands
        trace.notes.append(f"the locating re-run failed ({type(exc).__name__}: {exc})")
    return False


def locate_job(trace: Trace, cfg: Any, out_dir: Path) -> bool:
    """The locating re-run where this process writes the merged report and re-runs the job
    itself (:meth:`nanhunt.distributed.RankContext.job_reruns`: rank 0 of a torchrun job nanhunt
    did not launch, or the parent of workers the script starts), from the run's re-run config
    ``cfg``. True when Ctrl-C cut it short."""
    target = ["-m", cfg.module] if cfg.module else ["--", cfg.script]
    argv = [*cfg.options, *target, *cfg.args]
    return locate_guarded(trace, lambda: locate(
        trace, cfg.processes, argv, out_dir, env=cfg.env, quiet=cfg.quiet, cwd=cfg.cwd,
        spawned=cfg.workers is not None))


def adopt_located(trace: Trace, located: Trace | None, ended: str, nproc: int, *,
                  spawned: bool = False) -> None:
    """Where the locating re-run failed at the sentinel's step with an observed origin, its
    origin, diagnosis, recommendations and module table become the report's; otherwise the
    report keeps the sentinel's and says what the re-run found."""
    f = trace.first_failure
    assert f is not None
    how = (f"a full-tracing re-run of steps 0-{f.step} "
           + (f"of the script, which starts its {nproc} workers " if spawned else
              f"under torchrun on {nproc} processes ")
           + f"(files redirected to {LOCATE_DIR}/files; its report in {LOCATE_DIR}/report.json)")
    g = located.first_failure if located is not None else None
    if located is None or g is None or g.step != f.step or not g.observed:
        found = ("wrote no report (" + ended + ")" if located is None else
                 "found no failure" if g is None else
                 f"failed at step {g.step}, not {f.step}" if g.step != f.step else
                 "did not observe the origin either")
        trace.notes.append(f"the sentinel could not replay step {f.step}; {how} {found}: the "
                           "origin stays unobserved")
        return
    same_rank = f.rank is None or g.rank is None or g.rank == f.rank
    g.detail = "; ".join(filter(None, [
        g.detail, f"located by {how}, which failed at the same step"
        + ("" if same_rank else f" (on rank {g.rank}; the sentinel saw rank {f.rank} first)")]))
    trace.first_failure = g
    trace.problem = located.problem or trace.problem
    trace.diagnosis = located.diagnosis
    seen = {(w.rule, w.step, w.module) for w in located.warnings}
    trace.warnings = located.warnings + [w for w in trace.warnings
                                         if (w.rule, w.step, w.module) not in seen]
    trace.recommendations = located.recommendations
    trace.layers = located.layers or trace.layers
    trace.ops = located.ops
    trace.all_ranks_failed = located.all_ranks_failed
    # each rank's own first failure where the re-run saw one at the same step (the rest of
    # each rank's row, its steps, is the sentinel run's)
    theirs = {r.rank: r.first_failure for r in located.ranks}
    for r in trace.ranks:
        mine = theirs.get(r.rank)
        if mine is not None and r.first_failure is not None and mine.step == r.first_failure.step:
            r.first_failure = mine
    trace.notes.append(f"the sentinel could not replay step {f.step} (its weights are split "
                       f"across the ranks); {how} failed there too and names the origin: "
                       f"{g.where()}" + (f" on rank {g.rank}" if g.rank is not None else ""))
