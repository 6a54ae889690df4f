"""What both framework callbacks share: one :class:`~nanhunt.capture.Hunt` per training run,
traced inside the framework's training steps only, and the same reports as ``nanhunt diagnose``.

The framework callbacks only translate their hooks into :meth:`CallbackSession.start`,
:meth:`step_begin`, :meth:`step_end` and :meth:`finish`; everything else lives here, free of
any framework import.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import logging
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nanhunt.errors import NanhuntError

__all__ = ["CallbackSession"]

_log = logging.getLogger("nanhunt")

#: "full": every step traced; "sampled": every sample_every-th step; "sentinel": cheap checks
#: on every step and a full replay of the step that trips one
MODES = ("full", "sampled", "sentinel")


class _Vote:
    """What RankContext's store vote reads and calls (the CLI passes its Hunt; a callback stops
    through the framework instead, so it only records that some rank wants to stop)."""

    stop_on_problem = True

    def __init__(self, failure: Any) -> None:
        self.first_failure = failure
        self.stop = False

    def request_stop(self) -> None:
        self.stop = True


class CallbackSession:
    """One traced training run inside a framework.

    Options (the callbacks' keyword arguments):

    ``out``           folder for report.json / report.html / report.txt (default: the run's log
                      folder + ``/nanhunt-report``)
    ``target``        format to judge ranges against (default: from the framework's precision
                      setting, else what autocast or the parameters use)
    ``keep_going``    let training run on after the first failure
    ``mode``          ``"full"`` (every step traced), ``"sampled"`` (every ``sample_every``-th)
                      or ``"sentinel"`` (cheap checks every step, a traced replay of a step
                      that trips one)
    ``tensorboard``   ``True`` (the run's TensorBoard folder + ``/nanhunt``) or a folder: write
                      the per-step series there when training ends
    ``quiet``         no terminal summary (the headline still goes to the ``nanhunt`` logger)
    ``audit``         the precision audit (``nanhunt audit``) on the batches the framework trains
                      on: ``True`` (the run's own low-precision format, float16 for an fp32
                      run), a format or a comma-separated list / list of formats; the report
                      gains its ``precision`` section and any checked fp32 advice
    ``audit_steps``   training steps the audit measures (default 3), after ``audit_warmup``
                      plain training steps (default 1)
    """

    def __init__(
        self,
        *,
        out: str | Path | None = None,
        target: str | None = None,
        keep_going: bool = False,
        mode: str = "full",
        sample_every: int = 16,
        keep_steps: int = 64,
        allow_inf: tuple[str, ...] | list[str] = (),
        tensorboard: bool | str | Path = False,
        quiet: bool = False,
        strict: bool = False,
        audit: bool | str | list[str] | None = None,
        audit_steps: int = 3,
        audit_warmup: int = 1,
    ) -> None:
        if mode not in MODES:
            raise NanhuntError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if mode == "sentinel" and _sentinel_class() is None:
            raise NanhuntError("mode='sentinel' needs a nanhunt with nanhunt.pipeline.Sentinel")
        if sample_every < 1 or keep_steps < 1:
            raise NanhuntError("sample_every and keep_steps must be at least 1")
        if target is not None:
            from nanhunt.formats import get_format

            target = get_format(target).name  # a bad name fails here, not mid-training
        if audit_steps < 1 or audit_warmup < 0:
            raise NanhuntError("audit_steps must be at least 1 and audit_warmup at least 0")
        self.audit_targets: list[str] | None = None
        self.auditing = bool(audit)
        if self.auditing and audit is not True:
            from nanhunt.precision import parse_targets

            self.audit_targets = parse_targets(audit)  # type: ignore[arg-type]
        self.audit_steps, self.audit_warmup = audit_steps, audit_warmup
        self.audit: Any = None  # the AuditSession while training runs
        self.out = None if out is None else Path(out)
        self.target = target
        self.keep_going = keep_going
        self.mode = mode
        self.sample_every = sample_every if mode == "sampled" else 1
        self.keep_steps = keep_steps
        self.allow_inf = tuple(allow_inf)
        self.tensorboard = tensorboard
        self.quiet = quiet
        self.strict = strict
        self.hunt: Any = None
        self.trace: Any = None  # the finished run's Trace (on every rank; merged on rank 0)
        self.out_dir: Path | None = None
        self.tb_dir: Path | None = None
        self._ctx: Any = None
        self._run: Any = None
        self._paused = False
        self._framework = ""
        self._audit_error = ""

    # -- the run ------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.hunt is not None

    @property
    def first_failure(self) -> Any:
        return None if self.hunt is None else self.hunt.first_failure

    def start(self, model: Any, *, optimizer: Any = None, scaler: Any = None,
              target: str | None = None, target_source: str = "", out_dir: Path,
              tb_dir: Path | None, rank: int = 0, world_size: int = 1,
              framework: str = "", first_step: int = 0) -> None:
        """Start tracing (the framework's train-begin hook). A session left active by a run
        that raised (a framework without an exception hook) is finished first."""
        import torch

        from nanhunt.capture import Hunt
        from nanhunt.distributed import RankContext

        if self.hunt is not None:
            self.finish("crashed", error="training ended without its train-end hook")
        self.out_dir = self.out or out_dir
        self.tb_dir = None
        if self.tensorboard:
            self.tb_dir = Path(self.tensorboard) if not isinstance(self.tensorboard, bool) \
                else tb_dir
        self._ctx = RankContext(rank=rank, world_size=world_size)
        if world_size > 1:
            self._ctx = RankContext.from_env(self.out_dir)
            self._ctx.rank, self._ctx.world_size = rank, world_size
        chosen = self.target or target
        self._framework = framework
        common = {
            "target": chosen or "auto",  # auto: what autocast or the parameters use
            "keep_steps": self.keep_steps,
            "allow_inf": self.allow_inf,
            "first_step": first_step,  # steps numbered like the framework's (a resumed run)
        }
        if self.mode == "sentinel":
            # out=None: the reports are written here at the end, as for the other modes;
            # stop=False: the framework stops training, not an exception of ours
            self.hunt = _sentinel_class()(model, optimizer, scaler, out=None, stop=False,
                                          **common)
        else:
            self.hunt = Hunt(model, optimizer, scaler, sample_every=self.sample_every,
                             stop_on_problem=False, **common)
        self._run = _run_info(torch.__version__, framework)
        # empty: the session fills in where its automatic choice came from
        self._run.target_source = "option" if self.target else (target_source if chosen else "")
        self._run.world_size = world_size
        self.hunt.start()
        if self.hunt.aside is not False:  # under nanhunt diagnose, whose session traces it
            self.hunt = None
            return
        if self.auditing:
            self._start_audit()
        # a run that raises out of a framework with no exception hook (the HF Trainer) still
        # gets its report, at exit
        atexit.register(self._at_exit)
        self._paused = False
        self.pause()  # traced inside training steps only (not validation, logging, saving)

    def _start_audit(self) -> None:
        from nanhunt.precision import AuditSession

        # started after the Hunt, so that its Tensor.backward wrapper runs first and the Hunt
        # is paused for the replays (quiet); stopped before it (the wrappers unwind in order)
        self.audit = AuditSession(self.audit_targets, steps=self.audit_steps,
                                  warmup=self.audit_warmup, quiet=self._hunt_quiet)
        try:
            self.audit.start()
        except NanhuntError as exc:  # another audit in this process: train on, say why
            _log.error("nanhunt: the audit did not start: %s", exc)
            self._audit_error = str(exc)
            self.audit = None
            return
        self.audit.pause()

    @contextlib.contextmanager
    def _hunt_quiet(self) -> Iterator[None]:
        """The Hunt sees none of the audit's replays (they are not the user's computation)."""
        hunt = self.hunt
        was = getattr(hunt, "_active", None)
        if hunt is not None and was:
            hunt._active = False
        try:
            yield
        finally:
            if hunt is not None and was:
                hunt._active = True

    def _attach_audit(self, audit: Any, trace: Any) -> None:
        from nanhunt.precision import attach

        attach(trace, audit)

    def pause(self) -> None:
        """Between training steps: evaluation and logging are not training steps."""
        if self.audit is not None:
            self.audit.pause()
        hunt = self.hunt
        if hunt is not None and hunt._active:
            hunt._active = False
            self._paused = True

    def resume(self) -> None:
        if self.audit is not None:
            self.audit.resume()
        # a session that stopped itself after an internal error stays stopped
        if self.hunt is not None and self._paused:
            self.hunt._active = True
            self._paused = False

    def step_begin(self) -> None:
        self.resume()

    def step_end(self, step: int | None = None) -> bool:
        """End of the framework's training step: True when training should stop now."""
        hunt = self.hunt
        if hunt is None:
            return False
        failed = hunt.first_failure is not None
        # keep-going runs never stop early, so their ranks stay in step without a vote
        if self._ctx is not None and self._ctx.distributed and not self.keep_going:
            vote = _Vote(hunt.first_failure)
            self._ctx._vote(step if step is not None else hunt.step, vote)
            failed = failed or vote.stop
        self.pause()
        return failed and not self.keep_going

    def finish(self, status: str = "complete", error: str | None = None) -> Any:
        """Stop tracing and write the reports (rank 0 writes the merged one)."""
        hunt = self.hunt
        if hunt is None:
            return self.trace
        atexit.unregister(self._at_exit)
        audit, self.audit = self.audit, None
        if audit is not None:
            audit.resume()
            audit.stop()  # ranks what it measured (hooks out before the Hunt's come out)
        self.hunt = None
        self.resume()
        hunt.stop()
        if status == "complete" and hunt.first_failure is not None and not self.keep_going:
            status = "stopped"
        run = self._run
        run.status = status
        run.error = error
        run.finished = _now()
        from nanhunt.pipeline import analyse_and_report

        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            _log.error("nanhunt: cannot create report folder %s: %s", self.out_dir, exc)
            return None
        amend = None
        if audit is not None:
            amend = lambda t: self._attach_audit(audit, t)  # noqa: E731
        elif self._audit_error:
            amend = lambda t: t.notes.append(  # noqa: E731
                f"the audit did not start: {self._audit_error}")
        trace = analyse_and_report(hunt, run, self.out_dir, strict=self.strict,
                                   ctx=self._ctx, quiet=True, amend=amend)
        self.trace = trace
        if self._ctx.rank != 0:
            return trace
        self._summarise(trace)
        if self.tb_dir is not None:
            from nanhunt.report.tensorboard import export_tensorboard

            try:
                n = export_tensorboard(trace, self.tb_dir)
                _log.info("nanhunt: wrote %d TensorBoard points to %s", n, self.tb_dir)
            except NanhuntError as exc:
                _log.error("nanhunt: %s", exc)
        return trace

    def _at_exit(self) -> None:
        if self.hunt is not None:
            _exiting[0] = True  # the summary goes out now, after the script's own output
            self.finish("crashed", error="the process ended during training")

    def _summarise(self, trace: Any) -> None:
        from nanhunt.report.files import REPORT_FORMATS

        if not self.quiet:
            # never on stdout, never in the middle of the script's output (Lightning's test
            # table follows fit): on stderr when the process ends, as the CLI prints it after
            # the script; at once in an interactive session, where the process does not end
            if _interactive() or _exiting[0]:
                _print_summaries([(trace, self.out_dir)])
            else:
                if not _pending:
                    atexit.register(_print_pending)
                _pending.append((trace, self.out_dir))
        paths = ", ".join(str(self.out_dir / name) for name in REPORT_FORMATS.values())
        if trace.problem and trace.first_failure is not None:
            headline = f"nanhunt: problem at {trace.first_failure.where()}"
        elif trace.problem:
            headline = "nanhunt: a problem was found"
        else:
            headline = "nanhunt: no non-finite value or range problem found"
        (_log.warning if trace.problem else _log.info)("%s; reports: %s", headline, paths)


_pending: list[tuple[Any, Path | None]] = []  # summaries printed when the process ends
_exiting = [False]


def _interactive() -> bool:
    """A REPL, ``python -i`` or a notebook kernel: nothing waits for the process to end."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or "ipykernel" in sys.modules


def _print_pending() -> None:
    _exiting[0] = True
    done, _pending[:] = list(_pending), []
    _print_summaries(done)


def _print_summaries(items: list[tuple[Any, Path | None]]) -> None:
    from rich.console import Console

    from nanhunt.report import render_terminal

    console = Console(stderr=True, highlight=False)
    for trace, out_dir in items:
        # the first line says whose block this is: everything above it is the script's
        console.print(f"nanhunt: the training callback's summary (reports in {out_dir})",
                      soft_wrap=True)
        render_terminal(trace, console)


def _sentinel_class() -> Any:
    try:
        from nanhunt.pipeline import Sentinel
    except ImportError:
        return None
    return Sentinel


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _run_info(torch_version: str, framework: str) -> Any:
    from nanhunt._version import __version__
    from nanhunt.trace import RunInfo, host_platform

    return RunInfo(
        command=list(sys.argv),
        script=sys.argv[0] if sys.argv else "",
        python=platform.python_version(),
        torch=torch_version,
        nanhunt=__version__,
        platform=host_platform(),
        started=_now(),
        status="running",
        framework=framework,
    )


def precision_target(precision: str | None) -> str | None:
    """The format a framework precision setting trains in ("bf16-mixed" -> bfloat16)."""
    p = str(precision or "").lower()
    if "bf16" in p or "bfloat16" in p:
        return "bfloat16"
    if p.startswith("16") or "fp16" in p or "float16" in p or p == "half":
        return "float16"
    if "fp8" in p or "transformer-engine" in p:
        return "float8_e4m3fn"
    return None
