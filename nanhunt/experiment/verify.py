"""Re-run verification: run the user's script again with a fix installed and see if it trains.

After the diagnosis, :func:`verify_by_rerun` re-runs the script (same argv, cwd, environment)
in a child ``python -m nanhunt diagnose --fix ...`` for each candidate fix, narrowest first
(:func:`nanhunt.analyse.remedies.ladder`), up to the failure step plus enough steps to see recovery,
and judges the run (:func:`judge`): a fix is verified only when the loss stays finite, no
gradient goes non-finite beyond GradScaler's first calibration skips, no run of skipped steps
follows, the loss does not blow up (10x its first value) and the original failure is gone.
It stops at the first fix that works, after ``--verify N`` re-runs, or when about three times
the script's own time to the failure is spent. Torch-free: it only starts processes and reads
their reports.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanhunt.analyse.remedies import ladder, set_fix, verify_order
from nanhunt.fixspec import parse_fix
from nanhunt.trace import FixTry, Recommendation, Trace, Verification

__all__ = ["RerunConfig", "judge", "verify_by_rerun"]

RECOVERY_STEPS = 5  # steps past the original failure a re-run must train
BLOWUP = 10.0  # a loss this many times its first value is not training
CALIBRATION_SKIPS = 4  # GradScaler's first skips while it finds its scale
BUDGET_FACTOR = 3.0
RERUN_DIR = "reruns"


@dataclass
class RerunConfig:
    """How to run the user's script again (what the original run was given)."""

    script: str | None
    module: str | None
    args: list[str]
    cwd: str
    env: dict[str, str]
    tries: int = 4  # --verify N
    max_steps: int | None = None
    options: list[str] = field(default_factory=list)  # --target, --allow-inf ... as given
    script_seconds: float | None = None  # the original run's time to the failing step
    quiet: bool = False


def _target_steps(trace: Trace, max_steps: int | None) -> int:
    f = trace.first_failure
    last = max((s.index for s in trace.steps), default=0)
    step = f.step if f is not None else (trace.diagnosis.step if trace.diagnosis and
                                         trace.diagnosis.step is not None else last)
    n = max(step, last) + 1 + RECOVERY_STEPS
    return min(n, max_steps) if max_steps else n


def judge(original: Trace, rerun: Trace | None, target_steps: int, *, exit_code: int,
          output_tail: str = "") -> FixTry:
    """What a re-run showed: verified only when every criterion holds."""
    t = FixTry(target_steps=target_steps, fixes=list(rerun.run.fixes) if rerun else [])
    if rerun is None:
        last = output_tail.strip().splitlines()[-1:] or [f"exit status {exit_code}"]
        t.reason = f"the re-run wrote no report ({last[0][:200]})"
        return t
    steps = rerun.steps
    t.steps = len(steps)
    t.losses = [s.loss for s in steps]
    t.skipped = [s.index for s in steps if s.skipped]
    scales = [s.scale for s in steps if s.scale is not None]
    t.scale_first, t.scale_last = (scales[0], scales[-1]) if scales else (None, None)
    f = rerun.first_failure
    if f is not None:
        t.failure, t.failure_step = f.where(), f.step
        o = original.first_failure
        same = o is not None and (o.step, o.phase, o.module) == (f.step, f.phase, f.module)
        t.reason = ("the original failure remains: " if same else "new first failure: ") + \
            f.where()
        return t
    if rerun.run.status == "crashed":
        # before any judgement of its steps: a re-run that raised did not train, whatever the
        # steps it ran say (a TypeError at the start ran none)
        t.reason = f"the re-run crashed after {t.steps} step{'s' if t.steps != 1 else ''}: " \
            f"{(rerun.run.error or 'no error recorded').splitlines()[0][:300]}"
        return t
    bad = next((s for s in steps if s.loss is not None and not math.isfinite(s.loss)), None)
    if bad is not None:
        t.reason = f"loss {bad.loss} at step {bad.index}"
        return t
    applied = [s.index for s in steps if not s.skipped]
    after = [i for i in t.skipped if applied and i > applied[0]]
    streak = _longest_run(after)
    if not steps:
        t.reason = f"it ran no training step ({rerun.run.status})"
        return t
    if not applied:
        t.reason = f"GradScaler skipped all {len(steps)} steps"
        return t
    if streak >= 2 or len([i for i in t.skipped if i < applied[0]]) > CALIBRATION_SKIPS:
        t.reason = f"a run of {max(streak, len(t.skipped))} skipped steps"
        return t
    finite = [abs(v) for v in t.losses if v is not None]
    if finite and finite[0] > 0 and max(finite) > BLOWUP * finite[0]:
        t.reason = f"the loss blew up: {max(finite):.3g}, {max(finite) / finite[0]:.0f}x its " \
            f"first value {finite[0]:.3g}"
        return t
    if rerun.problem:
        what = rerun.diagnosis.message if rerun.diagnosis else "a problem"
        t.reason = f"the re-run still has a problem: {what}"
        return t
    ended = rerun.run.status == "complete" or rerun.run.exit_code == 0
    o = original.first_failure
    # a script that ends sooner than the target verifies when it ran past the failure, or, for
    # a problem with nothing non-finite (a rising loss, skips), when it ran all its steps again
    covered = t.steps > o.step if o is not None else t.steps >= len(original.steps)
    if t.steps < target_steps and not (ended and covered):
        t.reason = f"it stopped after {t.steps} of {target_steps} steps ({rerun.run.status})"
        return t
    t.verified = True
    calib = [i for i in t.skipped if i < applied[0]]
    t.reason = (f"{t.steps} steps, loss {_loss_span(t.losses)}, all finite; "
                + (f"{len(t.skipped)} skipped step{'s' if len(t.skipped) != 1 else ''} "
                   f"({'GradScaler calibration' if calib else 'isolated'})"
                   if t.skipped else "no skipped step")
                + (f"; scale {t.scale_first:g} -> {t.scale_last:g}" if scales else ""))
    return t


def _longest_run(indices: list[int]) -> int:
    best = run = 0
    prev = None
    for i in indices:
        run = run + 1 if prev is not None and i == prev + 1 else 1
        best, prev = max(best, run), i
    return best


def _loss_span(losses: list[float | None]) -> str:
    vals = [v for v in losses if v is not None]
    if not vals:
        return "not recorded"
    return f"{vals[0]:.4g} -> {vals[-1]:.4g}"


# ----------------------------------------------------------------------------- running


class _Progress:
    """The console side: one whole line per re-run; a live line at a terminal."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = not quiet and sys.stderr.isatty()
        self._drawn = False

    def say(self, text: str) -> None:
        if self.quiet:
            return
        self.clear()
        print(text, file=sys.stderr, flush=True)

    def live(self, text: str) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[2K" + text[: shutil.get_terminal_size().columns - 1])
            sys.stderr.flush()
            self._drawn = True

    def clear(self) -> None:
        if self._drawn:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()
            self._drawn = False


def _child_command(cfg: RerunConfig, fixes: list[str], out: Path, steps: int) -> list[str]:
    cmd = [sys.executable, "-m", "nanhunt", "diagnose", "--quiet", "--verify", "0",
           "--out", str(out), "--max-steps", str(steps), *cfg.options]
    for fix in fixes:
        cmd += ["--fix", fix]
    if cfg.script is not None:
        return [*cmd, "--", cfg.script, *cfg.args]
    return [*cmd, "-m", str(cfg.module), *cfg.args]


def _last_progress(path: Path) -> str:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


class _Server:
    """The fork server (nanhunt.cli.forkserver), started at the first re-run; None where the
    platform cannot fork (each re-run is then a fresh process)."""

    def __init__(self, cfg: RerunConfig) -> None:
        self.proc: subprocess.Popen | None = None
        self.startup = 0.0  # its imports, paid once (the original run paid them too)
        if hasattr(os, "fork"):
            t0 = time.monotonic()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nanhunt.cli.forkserver"], cwd=cfg.cwd, env=cfg.env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, bufsize=1)
            if not self.proc.stdout.readline():  # type: ignore[union-attr]
                self.close()  # it could not start: each re-run is a fresh process
            self.startup = time.monotonic() - t0

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def _run_child(cfg: RerunConfig, server: _Server | None, fixes: list[str], out: Path, steps: int,
               timeout: float, progress: _Progress, label: str) -> tuple[int, str, bool]:
    """Run one re-run: (exit status, the tail of its output, whether it ran out of time).
    Ctrl-C stops it."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(cfg.env, NANHUNT_RERUN="1", WANDB_MODE="disabled",
               NANHUNT_SCRATCH=str((out / "files").resolve()),
               NANHUNT_PROGRESS=str((out / "progress.txt").resolve()))
    log_path = out / "output.txt"
    argv = _child_command(cfg, fixes, out.resolve(), steps)
    if server is not None and server.proc is not None and server.proc.poll() is None:
        child: Any = _Forked(server.proc, {"argv": argv[3:], "cwd": cfg.cwd, "env": env,
                                           "log": str(log_path.resolve())})
    else:
        with open(log_path, "wb") as log:
            child = subprocess.Popen(argv, cwd=cfg.cwd, env=env, stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    start = time.monotonic()
    timed_out = False
    try:
        while child.poll() is None:
            if time.monotonic() - start > timeout:
                _stop(child)
                timed_out = True
                break
            last = _last_progress(out / "progress.txt")
            progress.live(f"nanhunt  {label}" + (f"  {last}" if last else ""))
    except KeyboardInterrupt:
        _stop(child)
        raise
    tail = log_path.read_text(encoding="utf-8", errors="replace")[-2000:] \
        if log_path.exists() else ""
    return (child.returncode if child.returncode is not None else -1), tail, timed_out


class _Forked:
    """A re-run forked by the server, with the subset of Popen that _run_child uses."""

    def __init__(self, server: subprocess.Popen, request: dict) -> None:
        self.server = server
        self.returncode: int | None = None
        server.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        server.stdin.flush()  # type: ignore[union-attr]
        self.pid = int(json.loads(server.stdout.readline())["pid"])  # type: ignore[union-attr]

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self.server.stdout], [], [], 0.2)
            if ready:
                line = self.server.stdout.readline()  # type: ignore[union-attr]
                self.returncode = int(json.loads(line)["code"]) if line else -1
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        end = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired("re-run", timeout or 0)
        return int(self.returncode or 0)


def _stop(proc: Any) -> None:
    with contextlib.suppress(OSError):
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _load(path: Path) -> Trace | None:
    try:
        return Trace.from_json(path.read_text(encoding="utf-8"))
    except Exception:  # a re-run killed mid-write, or none written: judged as no report
        return None


# ----------------------------------------------------------------------------- the search


def verify_by_rerun(trace: Trace, cfg: RerunConfig, out_dir: Path) -> None:
    """Verify the recommendations by re-running the script with each fix installed."""
    v = trace.verification = Verification(tries_allowed=cfg.tries,
                                          script_seconds=cfg.script_seconds)
    for rec in trace.recommendations:
        rec.verified = False
    if trace.run.world_size > 1:
        v.note = (f"re-run verification is single-process for now: not run for this "
                  f"{trace.run.world_size}-process run")
        _label_untried(trace, v.note)
        return
    if cfg.tries <= 0:
        v.note = "re-run verification is off (--verify 0)"
        _label_untried(trace, "not verified: re-run verification is off (--verify 0)")
        return
    if not trace.problem:
        v.note = "nothing to verify: no problem was found"
        return
    candidates = verify_order(trace.recommendations)
    if not candidates:
        v.note = "no recommendation can be installed from outside the script"
        _label_untried(trace, "not verified: needs a change to the code, no re-run can "
                              "install it")
        return
    steps = v.target_steps = _target_steps(trace, cfg.max_steps)
    v.budget_seconds = BUDGET_FACTOR * (cfg.script_seconds or 10.0)
    progress = _Progress(cfg.quiet)
    progress.say(f"nanhunt: verifying fixes: re-running the script up to {cfg.tries} times, "
                 f"{steps} steps each (--verify 0 turns this off)")
    scratch = out_dir / RERUN_DIR
    shutil.rmtree(scratch, ignore_errors=True)
    start = time.monotonic()
    winner: Recommendation | None = None
    server: _Server | None = None
    last_seconds = 0.0
    try:
        server = _Server(cfg)
        for rec in candidates:
            for rung in ladder(rec, trace):
                spent = time.monotonic() - start
                if v.tries >= cfg.tries:
                    break
                estimate = last_seconds  # the next re-run takes about as long as the last
                if v.tries and spent + estimate > v.budget_seconds:
                    v.note = (f"stopped after {v.tries} re-runs: the time budget "
                              f"({v.budget_seconds:.0f} s, {BUDGET_FACTOR:g}x the script's time "
                              "to the failure) was spent")
                    break
                v.tries += 1
                label = f"re-run {v.tries} of {cfg.tries}  --fix {' --fix '.join(rung)}"
                out = scratch / f"try-{v.tries}"
                t0 = time.monotonic()
                # a re-run already going gets to finish unless it runs far past the budget
                limit = max(v.budget_seconds - spent, 2.0 * (cfg.script_seconds or 10.0) + 10.0)
                code, tail, timed_out = _run_child(cfg, server, rung, out, steps, limit,
                                                   progress, label)
                result = judge(trace, _load(out / "report.json"), steps, exit_code=code,
                               output_tail=tail)
                if timed_out:
                    result.verified = False
                    result.reason = (f"stopped after {limit:.0f} s, past the time budget "
                                     f"({result.steps} steps run)")
                result.fixes = rung
                result.seconds = last_seconds = round(time.monotonic() - t0, 2)
                result.report = str(Path(RERUN_DIR) / f"try-{v.tries}" / "report.json")
                rec.tries.append(result)
                _collect_redirects(out, v)
                shutil.rmtree(out / "files", ignore_errors=True)  # what the script wrote
                progress.say(f"nanhunt: {label}: "
                             + ("verified: " if result.verified else "not verified: ")
                             + result.reason)
                if result.verified:
                    winner = rec
                    set_fix(rec, trace, [parse_fix(s) for s in rung])
                    break
            if winner is not None or v.tries >= cfg.tries or v.note:
                break
    except KeyboardInterrupt:
        v.interrupted = True
        v.note = "re-run verification was interrupted (Ctrl-C); what it found so far is kept"
        progress.say("nanhunt: " + v.note)
    finally:
        if server is not None:
            server.close()
        progress.clear()
        v.seconds = round(time.monotonic() - start, 2)
    _label(trace, winner, v)


def _collect_redirects(out: Path, v: Verification) -> None:
    path = out / "files" / "redirected.txt"
    with contextlib.suppress(OSError):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line and line not in v.redirected:
                v.redirected.append(line)


def _label_untried(trace: Trace, why: str) -> None:
    for rec in trace.recommendations:
        if rec.check != "replay" or not rec.replay:
            rec.verification = why if rec.fix else _code_change_text(rec)


def _code_change_text(rec: Recommendation) -> str:
    if rec.replay:
        return rec.verification
    return "not verified: needs a change to the code (no --fix installs it)"


def _label(trace: Trace, winner: Recommendation | None, v: Verification) -> None:
    for rec in trace.recommendations:
        if rec.tries:
            rec.check = "rerun"
            last = rec.tries[-1]
            if rec is winner:
                rec.verified = True
                rec.verification = "verified by re-run: " + last.reason
                if len(rec.tries) > 1:
                    rec.verification += (f" (re-run {len(rec.tries)} of the search; narrower "
                                         "fixes did not train)")
            else:
                rec.verification = f"not verified: {len(rec.tries)} re-run" + \
                    ("s" if len(rec.tries) != 1 else "") + f" did not train ({last.reason})"
        elif rec.code_change:
            rec.verification = rec.verification if rec.check == "replay" else \
                _code_change_text(rec)
        elif not rec.verified:
            why = ("another fix was verified first" if winner is not None else
                   v.note or "the --verify budget was used by other fixes")
            prefix = "checked by replaying the culprit: " if rec.check == "replay" and \
                rec.replay else ""
            rec.verification = (prefix + rec.replay + "; not re-run: " + why) if prefix else \
                f"not verified: not re-run ({why})"
    trace.recommendations.sort(key=lambda r: not r.verified)
