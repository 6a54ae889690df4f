"""After the run: trace -> zoom -> diagnose -> advise -> verify -> reports.

Each stage is guarded: a stage that fails leaves a note in the report instead of losing it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nanhunt.capture.sentinel import Sentinel as _BareSentinel
from nanhunt.replay.step import TripAnalyst
from nanhunt.trace import RunInfo, Trace, needs_locating

__all__ = ["Sentinel", "analyse", "analyse_and_report", "sentinel"]


def _guard(trace: Trace, stage: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # a report with a note beats no report
        trace.notes.append(f"{stage} failed: {type(exc).__name__}: {exc}")
        if "NANHUNT_DEBUG" in __import__("os").environ:
            traceback.print_exc()
        return None


def analyse(trace: Trace, snapshot: Any = None, *, strict: bool = False,
            out_dir: Path | None = None, optimizer_snapshot: Any = None) -> Trace:
    """Fill the op-level zoom, diagnosis, recommendations and their verification."""
    from nanhunt.replay import checks, files, module, optimizer

    if optimizer_snapshot is not None:
        _guard(trace, "optimizer replay", optimizer.zoom_optimizer, trace, optimizer_snapshot)
    if snapshot is not None:
        from nanhunt.replay.compiled import look_inside

        # a compiled module was seen at its boundary: name the layer inside by an eager replay
        snapshot = _guard(trace, "compiled-module replay", look_inside, trace, snapshot) \
            or snapshot
        _guard(trace, "op-level replay", module.zoom_into, trace, snapshot)
        if out_dir is not None:
            name = _guard(trace, "snapshot", files.save_snapshot, snapshot,
                          out_dir / "snapshot.pt", script=trace.run.script)
            if name:
                trace.snapshot = "snapshot.pt"
    try:
        from nanhunt.analyse.advise import advise
        from nanhunt.analyse.diagnose import diagnose
    except ImportError:  # pragma: no cover - during development only
        return trace
    _guard(trace, "diagnosis", diagnose, trace)
    if snapshot is not None:
        from nanhunt.replay.compiled import compiled_evidence

        compiled_evidence(trace)
    _promote_severe_underflow(trace)
    if trace.diagnosis is not None and trace.diagnosis.severity == "error":
        trace.problem = True  # e.g. a misused GradScaler before anything went non-finite
    _guard(trace, "advice", advise, trace)  # with each fix's --fix specs and snippet
    if snapshot is not None:
        _guard(trace, "replay checks", checks.check, trace, snapshot)
    if optimizer_snapshot is not None:
        _guard(trace, "optimizer replay checks", checks.check_optimizer, trace,
               optimizer_snapshot)
    for rec in trace.recommendations:
        if not rec.verification:
            rec.verification = checks.why_not_checked(rec.type, captured=snapshot is not None)
    return trace


#: a run that never went non-finite but loses this fraction of its gradients has a problem
SEVERE_UNDERFLOW = 0.9
#: ... or whose gradients, measured at a cast, flush to zero this often where they first do
SEVERE_FLUSH = 0.25


def _promote_severe_underflow(trace: Trace) -> None:
    """Gradients that (almost) all vanish are a range problem, not a warning: exit 1."""
    if trace.diagnosis is not None or trace.problem:
        return
    for w in trace.warnings:
        lost = w.data.get("subnormal", 0.0) + w.data.get("flushed", 0.0)
        # measured at a down-cast: a quarter of the gradient reaching a module flushed to zero
        flushed = (w.data.get("site") or {}).get("flushed_fraction", 0.0)
        measured = (w.data.get("site") or {}).get("source_zero") is not None
        if w.kind in ("underflow", "loss_scale") and (
                lost >= SEVERE_UNDERFLOW or (measured and flushed >= SEVERE_FLUSH)):
            trace.warnings.remove(w)
            w.severity = "error"
            trace.diagnosis = w
            trace.problem = True
            return


def analyse_and_report(hunt: Any, run: RunInfo, out_dir: Path, *, strict: bool = False,
                       ctx: Any = None, show_all: bool = False, quiet: bool = False,
                       rerun: Any = None, ctrl_c: Any = None,
                       amend: Callable[[Trace], Any] | None = None,
                       locate: Callable[[Trace, Any, Path], bool] | None = None) -> Trace:
    """Build the trace from a finished session, analyse it, verify its recommendations by
    re-running the script (``rerun``: a :class:`nanhunt.experiment.verify.RerunConfig`) and write
    every
    report form.

    ``ctrl_c`` (the CLI's SIGINT handler: ``pressed``, ``raising``) lets a Ctrl-C cut the
    analysis or the verification short; the report is written and KeyboardInterrupt raised
    after it. ``amend(trace)`` adds to the analysed trace before the reports are written (a
    callback's precision audit; rank 0's only, after the ranks are merged). ``locate(trace,
    rerun, out_dir)`` (the CLI's :func:`nanhunt.cli.launch.locate_job`) runs the locating
    re-run where this process re-runs a multi-process job itself; True when Ctrl-C cut it
    short."""
    from nanhunt.report import render_terminal, write_reports

    try:
        trace = hunt.trace(run)
    except Exception as exc:
        trace = Trace(run=run, notes=[f"building the trace failed: {type(exc).__name__}: {exc}"])
        trace.problem = hunt.first_failure is not None
    distributed = ctx is not None and ctx.distributed
    if distributed:
        ctx.leave()  # peers waiting for this rank's next step-end vote stop now
    # each rank keeps its own snapshot (OUT/ranks/rank-<r>/); rank 0 merges, only it reports
    note = "analysis interrupted (Ctrl-C): this report has what was found before it"
    if ctrl_c is not None and ctrl_c.pressed:  # pressed as the script ended
        trace.notes.append(note)
    else:
        try:
            if ctrl_c is not None:
                ctrl_c.raising = True
            analyse(
                trace,
                # a verification re-run is judged by its steps and first failure: no
                # replays, no snapshot
                None if run.rerun else hunt.snapshot,
                strict=strict,
                out_dir=ctx.rank_dir(out_dir) if distributed else out_dir,
                optimizer_snapshot=getattr(hunt, "optimizer_snapshot", None),
            )
        except KeyboardInterrupt:  # cut short: keep what the run recorded
            trace.notes.append(note)
        finally:
            if ctrl_c is not None:
                ctrl_c.raising = False  # writing the report is not interrupted
    if distributed:
        trace = _guard(trace, "merging ranks", ctx.merge, trace, out_dir) or trace
        if not ctx.writes_report:  # rank 0, or the parent of workers the script started
            return trace
    if amend is not None:
        _guard(trace, "adding the precision audit", amend, trace)
    # under nanhunt diagnose --nproc-per-node, the launcher may go on (a locating re-run, the
    # experiments as torchrun re-runs): it prints the summary then, not rank 0
    launcher = distributed and bool(_guard(
        trace, "deciding what the launcher does next", ctx.leaves_summary_to_launcher, trace,
        verify=rerun is not None and rerun.tries > 0))
    # a multi-process job re-run by this process: rank 0 of a torchrun job nanhunt did not launch,
    # or the parent of workers the script starts
    job = distributed and rerun is not None and not launcher
    stop_on_term = False
    if job:
        rerun = _guard(trace, "preparing the job's re-runs", ctx.job_reruns, rerun, trace) \
            or rerun
        if rerun.processes and rerun.tries > 0 and not (ctrl_c is not None and ctrl_c.pressed):
            # the merged report now, in case the re-runs are cut off (torchrun kills rank 0 30 s
            # after its SIGTERM); rewritten after them
            _write(trace, out_dir, write_reports, ("json",))
        stop_on_term = bool(rerun.nproc)  # rank 0 under torchrun: its SIGTERM stops the re-runs
    with _sigterm_interrupts(stop_on_term):
        if job and locate is not None and rerun.processes and needs_locating(trace) and \
                trace.run.status != "interrupted" and not (ctrl_c is not None and ctrl_c.pressed):
            if ctrl_c is not None:
                ctrl_c.raising = True
            try:
                if locate(trace, rerun, out_dir) and ctrl_c is not None:
                    ctrl_c.pressed = True  # the report is written, then 130
            finally:
                if ctrl_c is not None:
                    ctrl_c.raising = False
        if rerun is not None and not launcher and not (ctrl_c is not None and ctrl_c.pressed):
            from nanhunt.experiment.verify import verify_by_rerun

            if ctrl_c is not None:
                ctrl_c.raising = True  # Ctrl-C stops verification; it keeps what it found
            try:
                _guard(trace, "re-run verification", verify_by_rerun, trace, rerun, out_dir)
            finally:
                if ctrl_c is not None:
                    ctrl_c.raising = False
    paths = _write(trace, out_dir, write_reports, ("json",) if run.rerun else None)
    if launcher:
        quiet = True
    if not quiet:
        from rich.console import Console

        console = Console(stderr=True, highlight=False)
        _guard(trace, "terminal summary", render_terminal, trace, console, show_all=show_all)
        if paths:
            console.print("reports: " + ", ".join(str(p) for p in paths.values()),
                          soft_wrap=True)
    if ctrl_c is not None and ctrl_c.pressed:
        raise KeyboardInterrupt  # the CLI says so in one line and exits 130
    return trace


@contextlib.contextmanager
def _sigterm_interrupts(enabled: bool) -> Any:
    """While rank 0 of a torchrun job re-runs it: SIGTERM (torchrun stopping the job, Ctrl-C at
    its terminal) stops the re-runs as Ctrl-C does, so that the report is written before the
    SIGKILL that follows 30 s later."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _write(trace: Trace, out_dir: Path, write_reports: Any,
           formats: tuple[str, ...] | None = None) -> dict:
    try:
        return write_reports(trace, out_dir, **({"formats": formats} if formats else {}))
    except Exception as exc:
        # last resort: the JSON alone, so that nothing is lost
        print(f"nanhunt: writing the reports failed ({type(exc).__name__}: {exc}); "
              "writing report.json only", file=sys.stderr)
        from nanhunt.report.files import atomic_write_text

        trace.notes.append(f"rendering failed: {type(exc).__name__}: {exc}")
        path = out_dir / "report.json"
        atomic_write_text(path, trace.to_json())
        return {"json": path}


# ----------------------------------------------------------------------------- the sentinel


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and world size: torch.distributed's where a group is initialised,
    else torchrun's environment (one process where neither says more)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def locate_command(trace: Trace, world: int) -> str:
    """The command that names the layer of a step the sentinel could not replay on a sharded
    model: the job under ``nanhunt diagnose``, traced in full up to that step (the script's own
    sentinel stands aside there). A torchrun job on one machine gets ``--nproc-per-node``; on
    several, torchrun's own launch with nanhunt where the script goes; a script that starts its
    own workers (no torchrun) is run as a script, which starts them."""
    import shlex

    f = trace.first_failure
    assert f is not None
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    target = (["-m", spec.name.removesuffix(".__main__")] if spec is not None and spec.name
              not in ("__main__", "__mp_main__") else sys.argv[:1]) + sys.argv[1:]
    ours = ["--max-steps", str(f.step + 1), "--verify", "0"]
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if world > 1 and local is not None and local != str(world):
        return ("torchrun [your job's options] -m nanhunt diagnose "
                + shlex.join([*ours, *target]))
    nproc = ["--nproc-per-node", str(world)] if world > 1 and local is not None else []
    return shlex.join(["nanhunt", "diagnose", *nproc, *ours, *target])


def _sentinel_report(sentinel: Any) -> None:
    """Write a diagnosed sentinel's reports to its ``out`` (after the user's step returned);
    in a job of several processes, each rank's to ``out/ranks/rank-<r>/``."""
    import torch

    assert sentinel.out is not None
    rank, world = _rank_and_world()
    out = sentinel.out if world <= 1 else sentinel.out / "ranks" / f"rank-{rank}"
    out.mkdir(parents=True, exist_ok=True)
    run = RunInfo(command=list(sys.argv), script=sys.argv[0] if sys.argv else "",
                  torch=torch.__version__, status="running")
    run.world_size = world
    hint: list[str] = []

    def amend(trace: Trace) -> None:
        if world > 1:
            if trace.first_failure is not None:
                trace.first_failure.rank = rank
            trace.notes.append(
                f"rank {rank} of {world}: the sentinel in the script reports each rank on its "
                f"own (in {out}); nanhunt diagnose --nproc-per-node {world} merges the ranks "
                "and names the rank where the failure began")
        if needs_locating(trace):
            hint.append(locate_command(trace, world))
            trace.notes.append("to name the layer, run the job traced in full up to this step: "
                               + hint[0])

    sentinel.reported = analyse_and_report(sentinel, run, out, quiet=True, amend=amend)
    f = sentinel.first_failure
    who = f" (rank {rank} of {world})" if world > 1 else ""
    print(f"nanhunt sentinel{who}: first non-finite value at {f.where() if f else '?'}; "
          f"report in {out}/" + (f"; to name the layer: {hint[0]}" if hint else ""),
          file=sys.stderr)


class Sentinel(_BareSentinel):
    """The always-on sentinel with its analysis: a failing step is replayed after the user's
    step returns (:class:`nanhunt.replay.step.TripAnalyst`) and, with ``out``, reported there.
    Options as :class:`nanhunt.capture.sentinel.Sentinel`'s; see docs/api.md."""

    def __init__(self, model: Any = None, optimizer: Any = None, scaler: Any = None, *,
                 analyst: Any = None, **options: Any) -> None:
        super().__init__(model, optimizer, scaler,
                         analyst=analyst or TripAnalyst(report=_sentinel_report), **options)


def sentinel(model: Any = None, optimizer: Any = None, scaler: Any = None, *,
             out: str | Path | None = "nanhunt-report", target: str | None = None,
             stop: bool = False, **options: Any) -> Sentinel:
    """The always-on sentinel: a context manager, or call ``start()``/``stop()``."""
    return Sentinel(model, optimizer, scaler, out=out, target=target, stop=stop, **options)
