"""``nanhunt`` command line: diagnose, report, replay."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import platform
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nanhunt._version import __version__
from nanhunt.cli.args import (
    EXIT_CODES,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_SCRIPT_FAILED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    Parser,
    diagnose_parser,
    rerun_options,
    split_argv,
)
from nanhunt.errors import EXIT_INTERNAL, NanhuntError

__all__ = ["EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PROBLEM", "EXIT_SCRIPT_FAILED", "EXIT_USAGE",
           "entry", "main", "split_argv"]

_STARTED = time.monotonic()  # the script's time to its failure is measured from here

# the parser, argv splitting and exit codes live in cli_args (distributed.py needs them too)
_diagnose_parser, _Parser, _EXIT_CODES = diagnose_parser, Parser, EXIT_CODES


# ----------------------------------------------------------------------------- diagnose


class _Terminated(BaseException):
    pass


class _CtrlC:
    """nanhunt's own SIGINT handler, outside the user's script.

    Before the script starts it records the press and raises KeyboardInterrupt, as Python's
    handler does; the record matters because C code in the imports (numpy's, torch's) can
    swallow the exception, and the script must not start after a Ctrl-C. After the script it
    only records (``raising`` False) except while the analysis runs, so that a Ctrl-C cuts the
    analysis short but never loses the report of what the script ran. The script itself runs
    under Python's own handler, exactly as under ``python script.py``.
    """

    def __init__(self) -> None:
        self.pressed = False
        self.raising = True
        self._installed = False

    def install(self, *, raising: bool) -> None:
        self.raising = raising
        if not self._installed and _main_thread() \
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._installed = False

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.pressed = True
        if self.raising:
            raise KeyboardInterrupt


def _run_info(argv: Sequence[str], script: str, torch_version: str) -> Any:
    from nanhunt.trace import RunInfo, host_platform

    return RunInfo(
        command=["nanhunt", "diagnose", *argv],
        script=script,
        python=platform.python_version(),
        torch=torch_version,
        nanhunt=__version__,
        platform=host_platform(),
        started=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        status="running",
    )


def cmd_diagnose(argv: Sequence[str]) -> int:
    ours, script, module, script_args = split_argv(argv)
    opts = _diagnose_parser().parse_args(ours)
    if opts.script or opts.module:  # only possible through odd spellings such as --script
        raise NanhuntError("put options before the script")
    if script is None and module is None:
        raise NanhuntError("no script given (usage: nanhunt diagnose [options] train.py [args])")
    for name, value in (("--max-steps", opts.max_steps), ("--sample-every", opts.sample_every),
                        ("--keep-steps", opts.keep_steps), ("--nproc-per-node",
                                                            opts.nproc_per_node)):
        if value is not None and value < 1:
            raise NanhuntError(f"{name} must be at least 1")
    if opts.mode == "sentinel" and opts.sample_every != 1:
        raise NanhuntError("--sample-every applies to --mode full only")
    if opts.verify < 0:
        raise NanhuntError("--verify must be 0 or more")
    if opts.jobs is not None and opts.jobs < 1:
        raise NanhuntError("--jobs must be at least 1")
    if opts.budget is not None and not opts.budget > 0:
        raise NanhuntError("--budget must be a positive number of seconds")
    from nanhunt.fixspec import parse_fix

    for spec in opts.fix:
        parse_fix(spec)  # a malformed spec is a usage error before anything runs
    from nanhunt.cli.runner import Target, TargetMissing

    target = Target(script=script, module=module, args=script_args)
    target.check()
    if opts.nproc_per_node:
        from nanhunt.cli.launch import launch

        return launch(opts.nproc_per_node, list(argv))
    out_dir = Path(opts.out)
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NanhuntError(f"cannot create report folder {out_dir}: {exc.strerror}") from None
    ctrl_c = _CtrlC()
    ctrl_c.install(raising=True)
    try:
        return _diagnose(opts, target, list(argv), out_dir, ctrl_c)
    except TargetMissing:
        if created:  # a usage error leaves nothing behind
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        raise
    except Exception:
        if ctrl_c.pressed and not _script_started:
            # a Ctrl-C inside an import that the library turned into its own error (numpy
            # re-raises an ImportError): it is still the user's Ctrl-C
            raise KeyboardInterrupt from None
        raise
    finally:
        ctrl_c.uninstall()


def _diagnose(opts: argparse.Namespace, target: Any, argv: list[str], out_dir: Path,
              ctrl_c: _CtrlC) -> int:
    import torch

    from nanhunt.capture import StopRun
    from nanhunt.cli.live import LiveLine
    from nanhunt.cli.runner import print_user_traceback, run_target
    from nanhunt.cli.workers import make_session, patch_spawn
    from nanhunt.distributed import RankContext
    from nanhunt.experiment.fixes import FixMismatch, RunFixes

    ctx = RankContext.from_env(out_dir)
    zygotes = _zygotes(opts, ctx)
    live = LiveLine(enabled=not opts.quiet and ctx.rank == 0)
    fixes = RunFixes(opts.fix)
    failed_at: list[float] = []

    locate = _Locate.from_env()  # a control re-run: its failing step watched op by op

    def on_step(rec: Any, hunt: Any) -> None:
        if locate is not None:
            locate.on_step(rec.index)
        live.update(rec, hunt)
        # an optimizer fix on a loop without an optimizer is refused at its first step
        fixes.on_step(rec, trained=getattr(getattr(hunt, "cur", None), "did_backward", True))
        if hunt.first_failure is not None and not failed_at:
            failed_at.append(time.monotonic() - _STARTED)

    hunt = make_session(opts, ctx.step_hook(on_step))  # distributed: the ranks stop together
    run = _run_info(argv, target.argv0, torch.__version__)
    run.world_size = ctx.world_size
    old_term = None
    if hasattr(signal, "SIGTERM") and _main_thread():
        def _on_term(signum: int, frame: Any) -> None:
            raise _Terminated()

        old_term = signal.signal(signal.SIGTERM, _on_term)
    if ctrl_c.pressed:  # pressed during the imports and swallowed there: do not start
        raise KeyboardInterrupt
    ctrl_c.uninstall()
    global _script_started
    _script_started = True
    fixes.install()  # before the session, so that nanhunt observes the fixed program
    outcome = None
    hunt.start()
    try:
        if locate is not None:
            locate.on_step(-1)
        # workers the script starts itself (torch.multiprocessing) run under sessions of their own
        with live, patch_spawn(opts, out_dir, run, ctx, fixes):
            outcome = run_target(target, (StopRun, _Terminated, FixMismatch))
    finally:
        if locate is not None:
            locate.finish(out_dir)
        ctrl_c.install(raising=False)
        if old_term is not None and ctx.distributed:
            # torchrun sends SIGTERM to every worker once one fails: finish the report first
            signal.signal(signal.SIGTERM, ctx.defer_sigterm)
        try:
            # (an error of ours in the last transfer is a note in the report, never an
            # exception here; and the fixes come off even then, after the session's own
            # patches, in the reverse order of their installation)
            hunt.stop()
        finally:
            # a fix for the workers' training is theirs to apply
            mismatch = fixes.uninstall(completed=_ran_to_end(outcome) and ctx.workers is None)
        if old_term is not None and not ctx.distributed:
            signal.signal(signal.SIGTERM, old_term)
    if isinstance(outcome.error, FixMismatch) or mismatch:
        raise NanhuntError(outcome.error.message if isinstance(outcome.error, FixMismatch)
                           else mismatch)
    run.fixes, run.rerun = list(opts.fix), fixes.rerun
    if isinstance(outcome.error, _Terminated):
        outcome.status, outcome.exit_code = "interrupted", EXIT_TERMINATED
    # the script's own exit status (sys.exit(n), 1 for a crash, 130/143 for signals); none when
    # nanhunt stopped it
    run.exit_code = None if outcome.status == "stopped" else outcome.exit_code
    run.finished = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    run.status = outcome.status if outcome.status != "exited" else "complete"
    if outcome.status == "stopped":
        run.status = "stopped"
    if isinstance(outcome.error, _Terminated):
        run.error = "SIGTERM"
    elif outcome.status in ("crashed", "interrupted") and outcome.error is not None:
        run.error = f"{type(outcome.error).__name__}: {outcome.error}".strip().rstrip(":")
    if outcome.status == "crashed" and outcome.error is not None:
        from nanhunt.analyse.crash import describe_crash

        # where in the user's code it raised, and which module ran: rules name the cause
        hunt.crash = describe_crash(outcome.error, hunt.naming.released, step=hunt.step)
        if hunt.first_failure is not None and hasattr(outcome.error, "add_note"):
            outcome.error.add_note(
                f"nanhunt: first non-finite value at {hunt.first_failure.where()}")
        print_user_traceback(outcome.error)
    from nanhunt.cli.launch import locate_job
    from nanhunt.experiment.verify import RerunConfig
    from nanhunt.pipeline import analyse_and_report

    rerun = RerunConfig(
        script=target.script, module=target.module, args=list(target.args), cwd=os.getcwd(),
        env=dict(os.environ), tries=opts.verify, max_steps=opts.max_steps,
        options=rerun_options(opts), quiet=opts.quiet, jobs=opts.jobs, budget=opts.budget,
        # (a multi-process job's re-runs start every process again: its whole time)
        script_seconds=round(failed_at[0] if failed_at and not ctx.distributed
                             else time.monotonic() - _STARTED, 2),
        servers=zygotes)
    try:
        trace = analyse_and_report(
            hunt,
            run,
            out_dir,
            strict=opts.strict,
            ctx=ctx,
            show_all=opts.show_all,
            quiet=opts.quiet,
            rerun=rerun,
            ctrl_c=ctrl_c,
            amend=fixes.amend if fixes.notes else None,
            locate=locate_job,
        )
    finally:
        for zygote in zygotes:  # the ones verification did not take
            zygote.close()
        if old_term is not None and ctx.distributed:
            signal.signal(signal.SIGTERM, old_term)
    code = _exit_code(trace, outcome, opts.strict)
    if code == outcome.exit_code and outcome.status in ("complete", "exited") and \
            getattr(hunt, "internal_errors", None):
        code = EXIT_INTERNAL  # nothing found, but nanhunt stopped tracing: not a clean bill
    return ctx.exit_code(code, trace)


class _Locate:
    """In a control re-run (``NANHUNT_LOCATE_STEP=N``, set by re-run verification): the
    script's ops of step N watched live (:class:`nanhunt.replay.ops.StepLocator`), from the end
    of step N-1 (or the start) to the end of step N or of the run; what it found goes to
    ``located.json`` beside the re-run's report. For failures outside every module (a loss
    written by hand), the op and the line nanhunt's module replays cannot name."""

    def __init__(self, step: int) -> None:
        from nanhunt.replay.ops import StepLocator

        self.step = step
        self.mode = StepLocator(step)
        self.active = self.done = False

    @classmethod
    def from_env(cls) -> _Locate | None:
        value = os.environ.get("NANHUNT_LOCATE_STEP")
        if os.environ.get("NANHUNT_RERUN") != "1" or not value or not value.isdigit():
            return None
        return cls(int(value))

    def on_step(self, ended: int) -> None:
        """Step ``ended`` is over (-1: the script is about to start)."""
        if ended == self.step - 1 and not (self.active or self.done):
            with contextlib.suppress(Exception):
                self.mode.__enter__()
                self.active = True
        elif ended >= self.step:
            self._leave()

    def _leave(self) -> None:
        if self.active:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            if _get_current_dispatch_mode() is self.mode:  # never another mode of the script's
                with contextlib.suppress(Exception):
                    self.mode.__exit__(None, None, None)
            self.active, self.done = False, True

    def finish(self, out_dir: Path) -> None:
        self._leave()
        found = self.mode.found()
        if found is not None:
            import json

            with contextlib.suppress(OSError):
                (out_dir / "located.json").write_text(json.dumps(found), encoding="utf-8")


def _zygotes(opts: argparse.Namespace, ctx: Any) -> list[Any]:
    """Fork servers for re-run verification, forked now, before the script starts: torch and
    nanhunt are imported and nothing of the script's exists yet, so each re-run is a fork of
    this state instead of a fresh Python that imports torch again (:mod:`.serving`). None
    for a multi-process run (no experiment runs there), with --verify 0, or off the main
    thread."""
    if opts.verify <= 0 or ctx.world_size > 1 or ctx.distributed or not _main_thread() or \
            os.environ.get("NANHUNT_RERUN"):
        return []
    import importlib

    from nanhunt.cli import serving
    from nanhunt.experiment.verify import default_jobs

    for name in serving._PRELOAD:  # imported once, here, rather than in every zygote
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    return serving.zygotes(opts.jobs or default_jobs(), rerun)


def rerun(argv: list[str]) -> int:
    """:func:`main` in a child of a fork server: its clock starts now, not at the server's
    import."""
    global _STARTED
    _STARTED = time.monotonic()
    return main(argv)


def _ran_to_end(outcome: Any) -> bool:
    """Whether the script ran to its end (a fix that never applied is then an error)."""
    return outcome is not None and outcome.status in ("complete", "exited")


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _exit_code(trace: Any, outcome: Any, strict: bool) -> int:
    if trace.problem or (strict and trace.warnings):
        return EXIT_PROBLEM
    if trace.run.status == "crashed":  # distributed: rank 0's merged report, any rank's crash
        return EXIT_SCRIPT_FAILED
    if outcome.status == "interrupted":
        return outcome.exit_code
    if outcome.status == "crashed":
        return EXIT_SCRIPT_FAILED
    return outcome.exit_code


# ----------------------------------------------------------------------------- report / replay


def cmd_report(argv: Sequence[str]) -> int:
    p = _Parser(prog="nanhunt report", description="Render a saved report.json again.")
    p.add_argument("report", help="path to report.json")
    p.add_argument("--html", metavar="OUT", help="also write a self-contained HTML page")
    p.add_argument("--all", action="store_true", dest="show_all", help="show every module")
    p.add_argument("--tensorboard", metavar="LOGDIR",
                   help="also write the per-step series as TensorBoard events into LOGDIR "
                   "(needs nanhunt[tensorboard])")
    opts = p.parse_args(list(argv))
    from nanhunt.report import render_html, render_terminal
    from nanhunt.report.files import atomic_write_text
    from nanhunt.trace import Trace

    path = Path(opts.report)
    if path.is_dir():
        path = path / "report.json"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise NanhuntError(f"cannot read {opts.report}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise NanhuntError(f"{opts.report} is not a text file") from None
    trace = Trace.from_json(text)
    render_terminal(trace, _console(), show_all=opts.show_all)
    if opts.html:
        atomic_write_text(Path(opts.html), render_html(trace))
        print(f"nanhunt: wrote {opts.html}", file=sys.stderr)
    if opts.tensorboard:
        from nanhunt.report.tensorboard import export_tensorboard

        n = export_tensorboard(trace, opts.tensorboard)
        print(f"nanhunt: wrote {n} TensorBoard points to {opts.tensorboard}", file=sys.stderr)
    return EXIT_OK


def cmd_replay(argv: Sequence[str]) -> int:
    p = _Parser(prog="nanhunt replay",
                description="Re-run a culprit snapshot and print its op-level trace.")
    p.add_argument("snapshot", help="path to snapshot.pt (beside report.json)")
    p.add_argument("--dtype", choices=["as-captured", "float32", "float16", "bfloat16"],
                   default="as-captured", help="replay precision (default: %(default)s)")
    p.add_argument("--script", help="the training script that defines the module's class")
    opts = p.parse_args(list(argv))
    # before torch loads (seconds): a wrong path is one line at once
    for path, what in ((opts.snapshot, "snapshot"), (opts.script, "script")):
        if path is not None and not Path(path).exists():
            raise NanhuntError(f"no such {what}: {path}")
        if path is not None and not Path(path).is_file():
            raise NanhuntError(f"{path} is not a file")
    from nanhunt.replay.files import load_snapshot
    from nanhunt.replay.module import replay
    from nanhunt.replay.show import print_replay

    snap = load_snapshot(opts.snapshot, script=opts.script)
    result = replay(snap, dtype=None if opts.dtype == "as-captured" else opts.dtype)
    print_replay(snap, result, _console())
    return EXIT_OK


def _console() -> Any:
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich exits 1 here; a reader that stopped early (`| head`) is no error: main exits 0
            self.quiet = True
            raise BrokenPipeError

    return _Console(highlight=False)


def cmd_audit(argv: Sequence[str]) -> int:
    from nanhunt.cli.audit import cmd_audit as run

    return run(argv)


_COMMANDS = {"diagnose": cmd_diagnose, "audit": cmd_audit, "report": cmd_report,
             "replay": cmd_replay}

_TOP_HELP = f"""\
usage: nanhunt <command> [options] ...

nanhunt {__version__}: find where, why and how to fix NaN/Inf in mixed-precision PyTorch training.

commands:
  diagnose   run a training script under instrumentation and report the first failure
  audit      measure per layer how much accuracy fp16/bf16/fp8 costs (SQNR vs float32)
  report     render a saved report.json again (terminal, --html)
  replay     re-run a culprit snapshot and print its op-level trace

Run 'nanhunt <command> --help' for a command's options.

{_EXIT_CODES}"""


def main(argv: Sequence[str] | None = None) -> int:
    """The ``nanhunt`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_TOP_HELP)
        return EXIT_OK if argv else EXIT_USAGE
    if argv[0] == "--version":
        print(f"nanhunt {__version__}")
        return EXIT_OK
    command = _COMMANDS.get(argv[0])
    try:
        if command is None:
            raise NanhuntError(f"unknown command {argv[0]!r} (choose from diagnose, audit, "
                               "report, replay)")
        return command(argv[1:])
    except NanhuntError as exc:
        print(f"nanhunt: {exc}", file=sys.stderr)
        return exc.exit_code
    except SystemExit as exc:  # argparse's --help
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    except KeyboardInterrupt:  # before the script started (imports) or after it (analysis)
        _interrupted()
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `nanhunt report r.json | head`: a reader that stopped early
        _stdout_gone()
        return EXIT_OK


def _stdout_gone() -> None:
    # what is still buffered would fail again at exit: send it nowhere (Python's own advice)
    import os

    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _interrupted() -> None:
    # a second Ctrl-C while this line is written must not print a traceback either
    with contextlib.suppress(KeyboardInterrupt, OSError, ValueError):
        sys.stderr.write("nanhunt: interrupted\n")
        sys.stderr.flush()


#: the user's script has begun: from then on nanhunt exits the ordinary way (the script's atexit
#: handlers run)
_script_started = False


def entry() -> None:
    """The console script: ``nanhunt ...``."""
    try:
        code = main()
    except KeyboardInterrupt:  # between main's handlers: still one line, never a traceback
        _interrupted()
        code = EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED and not _script_started:
        exit_now(code)
    sys.exit(code)


def exit_now(code: int) -> None:
    """Exit with ``code`` at once. A Ctrl-C that a C extension's import code let escape can leave
    CPython marked as killed by SIGINT, and it would then end by SIGINT (-2) after our one line
    instead of exiting 130; nothing of the user's ran yet, so nothing is skipped."""
    import os

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
