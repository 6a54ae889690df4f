"""Workers the script starts itself: ``torch.multiprocessing.spawn`` (``mp.spawn``) and
``torch.multiprocessing.start_processes`` with the ``spawn``, ``fork`` or ``forkserver`` method.

``nanhunt diagnose`` wraps the function the script hands to ``start_processes``: each worker
runs it under a session of its own, as a rank does under torchrun (rank = the worker's index,
world = the number of workers), with the same options. The workers vote at every step end in the
user's process-group store (see :mod:`nanhunt.distributed`), so one rank's failure stops them
all after the same step; each writes its rank file, and the parent, once they are done, merges
them into the run's report and stops the script as a single process would have been stopped.

What the user sees stays what ``python train.py`` shows: the workers print nothing of
nanhunt's, a worker that raises sends the parent the traceback Python would (without nanhunt's
frames), and the parent raises what ``start_processes`` raises.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import signal
import sys
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SpawnedWorker", "WorkerConfig", "patch_spawn"]


@dataclass
class WorkerConfig:
    """What a worker needs to run as the parent's session would (picklable)."""

    opts: Any  # the parent's parsed options (argparse.Namespace)
    out_dir: str
    nprocs: int
    run_id: str
    run: Any  # the parent's RunInfo, copied into each worker's trace
    timeout: float


class SpawnedWorker:
    """The function handed to ``start_processes`` in place of the script's own: the script's
    function under a nanhunt session. Picklable (the ``spawn`` method sends it to the child)."""

    def __init__(self, fn: Any, config: WorkerConfig) -> None:
        self.fn = fn
        self.config = config

    def __call__(self, index: int, *args: Any) -> None:
        run_worker(self.fn, index, args, self.config, caller=sys._getframe(1))


def _forget_inherited_session() -> None:
    """A forked worker inherits the parent's live session (its hooks are in the copied memory):
    detach it there without flushing anything, so that the worker's own session starts clean."""
    from nanhunt.capture import session as _session

    inherited = _session._ACTIVE
    if inherited is None:
        return
    inherited._active = False
    with contextlib.suppress(Exception):
        inherited.cur.clear_handles()
    if inherited._stack is not None:
        with contextlib.suppress(Exception):
            inherited._stack.close()
        inherited._stack = None
    _session._ACTIVE = None
    if _PARENT_FIXES is not None:  # the parent's --fix patches, copied with its memory
        with contextlib.suppress(Exception):
            _PARENT_FIXES.uninstall(completed=False)


_PARENT_FIXES: Any = None  # the parent's RunFixes while its workers start (fork copies it)


class WorkerTerminated(BaseException):
    """SIGTERM in a worker (``start_processes`` stops the others once one fails)."""


def run_worker(fn: Any, index: int, args: tuple, config: WorkerConfig, *,
               caller: Any = None) -> None:
    """Run ``fn(index, *args)`` under a session, write this worker's rank file, then end as the
    function would have ended without nanhunt (return, raise, ``sys.exit``)."""
    from nanhunt.capture import StopRun
    from nanhunt.cli.runner import run_callable
    from nanhunt.distributed import RankContext, rank_file
    from nanhunt.experiment.fixes import FixMismatch, RunFixes
    from nanhunt.pipeline import analyse_and_report

    _forget_inherited_session()
    opts, out_dir = config.opts, Path(config.out_dir)
    ctx = RankContext(rank=index, world_size=config.nprocs, run_id=config.run_id,
                      timeout=config.timeout, parent_merges=True)
    with contextlib.suppress(OSError):
        rank_file(out_dir, index).unlink()
    hunt = make_session(opts, ctx.step_hook(None))
    fixes = RunFixes(opts.fix)
    main_thread = _main_thread()
    old_term = None
    if main_thread:
        def _on_term(signum: int, frame: Any) -> None:
            raise WorkerTerminated()

        old_term = signal.signal(signal.SIGTERM, _on_term)
    fixes.install()
    outcome = None
    hunt.start()
    try:
        outcome = run_callable(fn, (index, *args), (StopRun, WorkerTerminated, FixMismatch))
    finally:
        if main_thread:  # the parent stops the others once one fails: finish the report first
            signal.signal(signal.SIGTERM, ctx.defer_sigterm)
        hunt.stop()
        fixes.uninstall(completed=False)
    run = copy.deepcopy(config.run)
    finish_run_info(run, outcome, terminated=isinstance(outcome.error, WorkerTerminated))
    if outcome.status == "crashed" and outcome.error is not None:
        from nanhunt.analyse.crash import describe_crash

        hunt.crash = describe_crash(outcome.error, hunt.naming.released, step=hunt.step)
    try:
        analyse_and_report(hunt, run, out_dir, strict=opts.strict, ctx=ctx, quiet=True)
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    error = outcome.error
    if outcome.status == "crashed" and isinstance(error, Exception):
        _raise_as_python_would(error, caller)
    if outcome.status == "exited" or isinstance(error, (KeyboardInterrupt, WorkerTerminated)):
        if isinstance(error, WorkerTerminated):  # end by the signal, as its default action does
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        raise error  # type: ignore[misc]
    if outcome.status == "crashed" and error is not None:  # a BaseException of the user's
        raise error
    # complete, or stopped by nanhunt with every other worker: the worker returns


def _raise_as_python_would(exc: Exception, caller: Any) -> None:
    """End the worker as ``torch.multiprocessing``'s ``_wrap`` ends it when the function raises:
    the traceback in its error file, exit code 1. The traceback is the one Python would print
    (``_wrap``'s frame, then the user's), without nanhunt's frames; the parent raises it."""
    from nanhunt.cli.runner import user_traceback_text

    error_file = caller.f_locals.get("error_file") if caller is not None else None
    if caller is None or caller.f_code.co_name != "_wrap" or not isinstance(error_file, str):
        raise exc  # not called from torch's _wrap: let it propagate
    head = traceback.StackSummary.extract([(caller, caller.f_lineno)], capture_locals=False)
    text = user_traceback_text(exc, head=head)
    with open(error_file, "wb") as fh:
        pickle.dump(text, fh)
    sys.exit(1)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def make_session(opts: Any, on_step: Any) -> Any:
    """The session ``nanhunt diagnose`` runs the script under (a rank's, a worker's)."""
    common = {"target": opts.target, "keep_steps": opts.keep_steps,
              "allow_inf": opts.allow_inf, "max_steps": opts.max_steps, "on_step": on_step}
    if opts.mode == "sentinel":
        from nanhunt.pipeline import Sentinel

        # the reports are written after the run, as for full tracing
        session: Any = Sentinel(out=None, stop=not opts.keep_going, **common)
    else:
        from nanhunt.capture import Hunt

        session = Hunt(sample_every=opts.sample_every, stop_on_problem=not opts.keep_going,
                       **common)
    session.owns_process = True  # the script's own sessions stand aside under it
    return session


def finish_run_info(run: Any, outcome: Any, *, terminated: bool) -> None:
    """How the script (or a worker's function) ended, into ``run``."""
    import datetime as _dt

    if terminated:
        outcome.status = "interrupted"
    # the script's own exit status (sys.exit(n), 1 for a crash, 130/143 for signals); none when
    # nanhunt stopped it
    run.exit_code = None if outcome.status == "stopped" else outcome.exit_code
    run.finished = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    run.status = outcome.status if outcome.status != "exited" else "complete"
    if terminated:
        run.error = "SIGTERM"
    elif outcome.status in ("crashed", "interrupted") and outcome.error is not None:
        run.error = f"{type(outcome.error).__name__}: {outcome.error}".strip().rstrip(":")


# ----------------------------------------------------------------------------- the parent


@contextlib.contextmanager
def patch_spawn(opts: Any, out_dir: Path, run: Any, ctx: Any, fixes: Any) -> Any:
    """While the script runs: ``torch.multiprocessing``'s ``start_processes`` (and so
    ``spawn``) start their workers under :class:`SpawnedWorker`. Patched only where torch's
    multiprocessing is already imported or gets imported by the script (the patch is installed
    lazily by an import of it would cost the torch import: it is installed at once when torch
    is imported, which the CLI has done by now)."""
    global _PARENT_FIXES
    import torch.multiprocessing as tmp

    tspawn = sys.modules["torch.multiprocessing.spawn"]  # (the package's `spawn` is a function)

    original = tspawn.start_processes

    def start_processes(fn: Any, args: tuple = (), nprocs: int = 1, join: bool = True,
                        daemon: bool = False, start_method: str = "spawn") -> Any:
        from nanhunt.distributed import _env_timeout

        group_id = f"spawn:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        config = WorkerConfig(opts=opts, out_dir=str(out_dir), nprocs=int(nprocs),
                              run_id=group_id, run=copy.deepcopy(run), timeout=_env_timeout())
        ctx.add_workers(int(nprocs), group_id, time.time(), out_dir)
        result = original(SpawnedWorker(fn, config), args, nprocs, join, daemon, start_method)
        if join and ctx.workers_stopped():
            from nanhunt.capture import StopRun

            raise StopRun("nanhunt stopped the script after its workers stopped together at "
                          "the step where the first non-finite value appeared")
        return result

    start_processes.__wrapped__ = original  # type: ignore[attr-defined]
    saved = (tspawn.start_processes, tmp.start_processes)
    tspawn.start_processes = start_processes
    tmp.start_processes = start_processes
    _PARENT_FIXES = fixes
    try:
        yield
    finally:
        _PARENT_FIXES = None
        tspawn.start_processes, tmp.start_processes = saved
