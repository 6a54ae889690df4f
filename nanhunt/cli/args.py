"""What the command line and the distributed launcher both need: exit codes, the diagnose
parser and argv splitting.

Kept apart from ``cli.py`` (which imports ``distributed.py``) so that ``distributed.py`` can use
them without an import cycle, and kept torch-free so that ``--help`` and usage errors are fast.
Add new ``nanhunt diagnose`` options in :func:`diagnose_parser` (and, when they take a value, in
:data:`VALUE_OPTIONS`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from nanhunt.errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_SCRIPT_FAILED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    NanhuntError,
)
from nanhunt.formats import FORMATS

__all__ = [
    "DIAGNOSE_HELP",
    "EXIT_CODES",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_SCRIPT_FAILED",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "VALUE_OPTIONS",
    "Parser",
    "diagnose_parser",
    "split_argv",
]


EXIT_CODES = """\
exit codes:
  0    the script ran and no non-finite value or range problem was found
  1    a problem was found and reported
  2    usage error (missing script or module, bad option, unreadable report)
  3    the script failed for another reason (its traceback is printed as Python prints it)
  4    nanhunt itself failed (an internal error, one line on stderr); the script ran as
       without nanhunt and the report keeps what was recorded until then
  130  interrupted (Ctrl-C); a partial report is written if the script had started
  143  terminated (SIGTERM); a partial report is written
  n    the script called sys.exit(n) and no problem was found
"""

DIAGNOSE_HELP = """\
Run a training script under instrumentation and report where, why and how to fix the first
non-finite value. Options go before the script; everything after the script belongs to it.

  nanhunt diagnose [options] train.py [script args ...]
  nanhunt diagnose [options] -m package.module [args ...]
"""


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one ``nanhunt: ...`` line (exit 2, no usage dump)."""

    def error(self, message: str) -> None:
        raise NanhuntError(message)


def diagnose_parser() -> argparse.ArgumentParser:
    """The options of ``nanhunt diagnose`` (the script and its arguments are split off first)."""
    p = Parser(prog="nanhunt diagnose", description=DIAGNOSE_HELP, epilog=EXIT_CODES,
               formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--out", default="nanhunt-report", metavar="DIR",
                   help="folder for report.json, report.html, report.txt (default: %(default)s)")
    p.add_argument("--target", default=None, choices=sorted(FORMATS),
                   help="format to judge ranges against (default: the low-precision format "
                   "autocast or the parameters use, float16 when the run has none)")
    p.add_argument("--keep-going", action="store_true",
                   help="let the script run on after the first failure")
    p.add_argument("--max-steps", type=int, metavar="N", help="stop the script after N steps")
    p.add_argument("--allow-inf", action="append", default=[], metavar="PATTERN",
                   help="module-name glob whose non-finite values are intentional (repeatable)")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    p.add_argument("--sample-every", type=int, default=1, metavar="N",
                   help="full statistics every N steps, a cheap finite check otherwise")
    p.add_argument("--mode", choices=("full", "sentinel"), default="full",
                   help="full: trace every step; sentinel: cheap checks every step, the "
                        "failing step replayed with full tracing (default: %(default)s)")
    p.add_argument("--keep-steps", type=int, default=64, metavar="N",
                   help="steps of detailed records kept in memory (default: %(default)s)")
    p.add_argument("--all", action="store_true", dest="show_all",
                   help="show every module in the terminal summary")
    p.add_argument("--quiet", action="store_true", help="no live line and no summary")
    p.add_argument("--nproc-per-node", type=int, metavar="N",
                   help="launch N processes with torch.distributed's launcher (DDP)")
    p.add_argument("--fix", action="append", default=[], metavar="SPEC",
                   help="install a fix from outside the script, e.g. fp32:encoder.blocks.*.wo, "
                        "clamp:PATTERN=V, init-scale=1024 (repeatable; docs/cli.md)")
    p.add_argument("--verify", type=int, default=4, metavar="N",
                   help="re-run the script up to N times to verify fixes (default: "
                        "%(default)s; 0: off)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="re-runs at once (default: the CPU cores, at most 4)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="wall time for all re-runs together (default: 12x the script's time "
                        "to the failure, at least 60 s); the report names what did not run")
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module as a script")
    p.add_argument("script", nargs="?", help="the training script")
    return p


#: the diagnose options that take a value: split_argv must skip the value, not stop at it
VALUE_OPTIONS = {"--out", "--target", "--max-steps", "--allow-inf", "--sample-every",
                 "--keep-steps", "--nproc-per-node", "--fix", "--verify", "--mode",
                 "--jobs", "--budget"}


def split_argv(argv: Sequence[str], value_options: frozenset[str] | set[str] | None = None,
               ) -> tuple[list[str], str | None, str | None, list[str]]:
    """Split at the script: (our options, script, module, script args).

    Done by hand because argparse's REMAINDER drops a ``--`` that belongs to the script.

    >>> split_argv(["--out", "r", "train.py", "--out", "s"])
    (['--out', 'r'], 'train.py', None, ['--out', 's'])
    """
    ours: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            if i + 1 >= len(argv):
                break
            return ours, argv[i + 1], None, list(argv[i + 2:])
        if tok == "-m":
            if i + 1 >= len(argv):
                raise NanhuntError("-m needs a module name")
            return ours, None, argv[i + 1], list(argv[i + 2:])
        if tok.startswith("-m") and not tok.startswith("--"):
            return ours, None, tok[2:], list(argv[i + 1:])
        if tok.startswith("-") and tok != "-":
            ours.append(tok)
            if tok in (VALUE_OPTIONS if value_options is None else value_options):
                if i + 1 >= len(argv):
                    raise NanhuntError(f"{tok} needs a value")
                ours.append(argv[i + 1])
                i += 1
            i += 1
            continue
        return ours, tok, None, list(argv[i + 1:])
    return ours, None, None, []


def rerun_options(opts: argparse.Namespace) -> list[str]:
    """The options a verification re-run keeps from this run (its --fix are added to them)."""
    out = ["--target", opts.target] if opts.target else []
    out += ["--keep-steps", str(opts.keep_steps), "--sample-every", str(opts.sample_every)]
    for pattern in opts.allow_inf:
        out += ["--allow-inf", pattern]
    for spec in opts.fix:
        out += ["--fix", spec]
    return out
