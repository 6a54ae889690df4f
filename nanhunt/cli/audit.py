"""``nanhunt audit``: run a training script and audit a few of its steps in a target format."""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nanhunt._version import __version__
from nanhunt.cli.args import split_argv
from nanhunt.errors import NanhuntError
from nanhunt.precision import parse_targets

__all__ = ["cmd_audit"]

_HELP = """\
Run a training script and measure, for every module, how much accuracy a low-precision format
costs it before anything turns NaN: its SQNR against float32 on the same inputs, end to end,
and for its gradient. The worst layers come first; float32 is advised only for layers that
lose far more than the rest, checked by replaying the step with the advice applied.
Options go before the script; everything after the script belongs to it.

  nanhunt audit [options] train.py [script args ...]
  nanhunt audit [options] -m package.module [args ...]
"""

_EPILOG = """\
exit codes:
  0    audited; no layer stands out (or the script's own sys.exit code)
  1    a layer loses far more than the rest: an fp32_module recommendation was made
  2    usage error
  3    the script failed (its traceback is printed as Python prints it)
  130  interrupted (Ctrl-C)
"""

_VALUE_OPTIONS = {"--out", "--target", "--steps", "--warmup"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        raise NanhuntError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nanhunt audit", description=_HELP, epilog=_EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--target", metavar="FORMATS",
                   help="float16, bfloat16, float8_e4m3fn or float8_e5m2; comma-separated for "
                        "side by side (default: the run's own low-precision dtype, float16 for "
                        "an fp32 run)")
    p.add_argument("--steps", type=int, default=3, metavar="N",
                   help="audited steps after the warm-up (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="plain steps before the audit starts (default: %(default)s)")
    p.add_argument("--out", default="nanhunt-audit", metavar="DIR",
                   help="folder for report.json, report.html, report.txt (default: %(default)s)")
    p.add_argument("--all", action="store_true", dest="show_all",
                   help="show every layer in the terminal summary")
    p.add_argument("--quiet", action="store_true", help="no terminal summary")
    return p


def _split_here(argv: Sequence[str]) -> tuple[list[str], str | None, str | None, list[str]]:
    """Split at the script, as ``nanhunt diagnose`` does, with the audit's own value options."""
    return split_argv(argv, _VALUE_OPTIONS)


class _NeverRaised(BaseException):
    pass


def cmd_audit(argv: Sequence[str]) -> int:
    ours, script, module, script_args = _split_here(argv)
    opts = _parser().parse_args(ours)
    if script is None and module is None:
        raise NanhuntError("no script given (usage: nanhunt audit [options] train.py [args])")
    if opts.steps < 1:
        raise NanhuntError("--steps must be at least 1")
    if opts.warmup < 0:
        raise NanhuntError("--warmup must be at least 0")
    targets = parse_targets(opts.target)
    from nanhunt.cli.runner import Target

    target = Target(script=script, module=module, args=script_args)
    target.check()
    out_dir = Path(opts.out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NanhuntError(f"cannot create report folder {out_dir}: {exc.strerror}") from None
    return _audit(opts, targets, target, list(argv), out_dir)


def _audit(opts: argparse.Namespace, targets: list[str] | None, target: Any, argv: list[str],
           out_dir: Path) -> int:
    import torch

    from nanhunt.cli.runner import print_user_traceback, run_target
    from nanhunt.precision import build_trace
    from nanhunt.precision._session import AuditSession
    from nanhunt.trace import RunInfo, host_platform

    run = RunInfo(command=["nanhunt", "audit", *argv], script=target.argv0,
                  python=platform.python_version(), torch=torch.__version__,
                  nanhunt=__version__, platform=host_platform(),
                  started=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  status="running")
    session = AuditSession(targets, steps=opts.steps, warmup=opts.warmup)
    session.start()
    try:
        outcome = run_target(target, _NeverRaised)
    finally:
        session.stop()
    run.finished = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    run.status = "complete" if outcome.status == "exited" else outcome.status
    run.device = session.auditor.device
    if outcome.status in ("crashed", "interrupted") and outcome.error is not None:
        run.error = f"{type(outcome.error).__name__}: {outcome.error}".strip().rstrip(":")
    if outcome.status == "crashed" and outcome.error is not None:
        print_user_traceback(outcome.error)
    trace = build_trace(session, run)
    from nanhunt.report import render_terminal, write_reports

    paths = write_reports(trace, out_dir)
    if not opts.quiet:
        from rich.console import Console

        console = Console(stderr=True, highlight=False)
        render_terminal(trace, console, show_all=opts.show_all)
        console.print("reports: " + ", ".join(str(p) for p in paths.values()), soft_wrap=True)
    if outcome.status == "interrupted":
        code = outcome.exit_code
    elif outcome.status == "crashed":
        code = 3
    elif trace.recommendations:
        code = 1
    else:
        code = outcome.exit_code
    run.exit_code = code
    sys.stderr.flush()
    return code
