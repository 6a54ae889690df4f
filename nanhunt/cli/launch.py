"""``nanhunt diagnose --nproc-per-node N``: the same run under torch.distributed's own launcher;
rank 0 merges the ranks' reports (:mod:`nanhunt.distributed`), and the launcher falls back to
merging the rank files itself when rank 0 wrote none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nanhunt.cli.args import diagnose_parser, split_argv
from nanhunt.distributed import _LAUNCHER_ENV, merge_rank_files
from nanhunt.errors import EXIT_INTERRUPTED, EXIT_PROBLEM, EXIT_SCRIPT_FAILED, NanhuntError
from nanhunt.trace import Trace

__all__ = ["launch", "torchrun_command"]


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
    if trace is None:
        trace = merge_rank_files(out_dir, nproc, newer_than=started - 1)
        if trace is None:
            print(f"nanhunt: the ranks wrote no report (torchrun exited {rc})", file=sys.stderr)
            return EXIT_INTERRUPTED if interrupted else (rc or EXIT_SCRIPT_FAILED)
        trace.notes.append("rank 0 wrote no merged report; the launcher merged the rank files")
        _write_fallback(trace, out_dir, quiet=opts.quiet, show_all=opts.show_all)
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
