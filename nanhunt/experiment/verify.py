"""Diagnosis by experiment and re-run verification: run the user's script again, unchanged
(the control) and with one change at a time, and see whether the failure goes away.

After the diagnosis, :func:`verify_by_rerun` re-runs the script (same argv, cwd, environment,
seeds) in children ``python -m nanhunt diagnose --fix ...``, ``--jobs`` at a time, each to the
horizon max(2 x the failure step, failure step + 20) (:mod:`nanhunt.experiment.ladder`): first the
control and float32 everywhere, then the rungs their outcomes call for (bfloat16, no
GradScaler; or lower learning rates, the failing batch replaced), then each candidate fix,
narrowest first (:func:`nanhunt.analyse.remedies.ladder`). A fix is verified only when the control
reproduced the failure and the fix's re-run trained past the horizon (or to the script's end)
with finite losses, no skip streak, and losses within the control's noise of the float32
experiment where one ran (:func:`judge`, :func:`_conditions`). ``--budget`` caps the whole;
the rungs it leaves out are named. Torch-free: it only starts processes and reads reports.
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

from nanhunt._waiting import PollWait
from nanhunt.analyse.remedies import cure_rank, ladder, set_fix, verify_order
from nanhunt.experiment.ladder import (
    Rung,
    batch_runs,
    batches_said,
    blew_up,
    classify,
    control_facts,
    cured,
    cured_batch,
    divergence_batch_rungs,
    excuse_cycles,
    failure_step,
    first_rungs,
    horizon,
    learning,
    lines_runs,
    loss_gap,
    loss_span,
    next_rungs,
    outcome,
    rung_value,
    same_problem,
    silent_candidate,
    silent_verdict,
    suspect_rungs,
    unlearned,
    warmup_verdict,
)
from nanhunt.experiment.ladder import (
    drop as _drop,
)
from nanhunt.experiment.region import Bisection
from nanhunt.experiment.region import spec as region_spec
from nanhunt.fixspec import parse_fix
from nanhunt.trace import (
    Experiment,
    Experiments,
    Finding,
    FixTry,
    Recommendation,
    Trace,
    Verification,
)

__all__ = ["RerunConfig", "judge", "verify_by_rerun"]

CALIBRATION_SKIPS = 4  # GradScaler's first skips while it finds its scale
BUDGET_FACTOR = 12.0  # the default --budget: this many times the script's time to the failure
BUDGET_MIN = 60.0  # ... and never less than this many seconds
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
    jobs: int | None = None  # --jobs: re-runs at once (None: the cores, at most 4)
    budget: float | None = None  # --budget SECONDS for all re-runs (None: BUDGET_FACTOR x)
    #: fork servers made before the script started (nanhunt.cli.serving.Zygote), taken
    #: one per slot; a slot without one starts ``python -m nanhunt.cli.forkserver``
    servers: list[Any] = field(default_factory=list)
    #: a torchrun job's processes per node: each re-run is the same job under
    #: ``torch.distributed.run --standalone`` (``nanhunt diagnose --nproc-per-node``), one at
    #: a time, with no fork server
    nproc: int | None = None
    #: the number of workers the script starts itself (torch.multiprocessing): each re-run is
    #: the script again (it starts them again), one at a time
    workers: int | None = None
    #: why this multi-process job cannot be re-run (a job on several machines)
    not_rerun: str | None = None
    #: seconds a stopped re-run gets before it is killed (default: 40 for a multi-process
    #: job, 5 otherwise)
    stop_grace: float | None = None

    @property
    def processes(self) -> int | None:
        """The processes each re-run takes, for a multi-process job (None: one)."""
        return self.nproc or self.workers


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
    blown = blew_up(original, steps)
    if blown:
        t.reason = blown
        return t
    if rerun.problem and same_problem(original, rerun):
        # the original's own problem came back (another finding in a run that trained is said,
        # as in the experiments' outcomes, not held against the fix)
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
    other = (f" (its own diagnosis, not the original problem: "
             f"{rerun.diagnosis.kind.replace('_', ' ')})" if rerun.problem and rerun.diagnosis
             else "")
    t.reason = (f"{t.steps} steps, loss {loss_span(t.losses)}, all finite; "
                + (f"{len(t.skipped)} skipped step{'s' if len(t.skipped) != 1 else ''} "
                   f"({'GradScaler calibration' if calib else 'isolated'})"
                   if t.skipped else "no skipped step")
                + (f"; scale {t.scale_first:g} -> {t.scale_last:g}" if scales else "") + other)
    return t


def _longest_run(indices: list[int]) -> int:
    best = run = 0
    prev = None
    for i in indices:
        run = run + 1 if prev is not None and i == prev + 1 else 1
        best, prev = max(best, run), i
    return best


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
    launcher = [sys.executable, "-m", "nanhunt"] if not cfg.nproc else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={cfg.nproc}", "-m", "nanhunt"]
    cmd = [*launcher, "diagnose", "--quiet", "--verify", "0",
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
        while cfg.servers:  # forked before the script started: its imports already paid
            self.proc = cfg.servers.pop(0)
            if self.proc.poll() is None and self.proc.stdout.readline():
                return
            self.close()
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


class _Forked(PollWait):
    """A re-run forked by the server, with the subset of Popen that _run_child uses."""

    what = "re-run"

    def __init__(self, server: subprocess.Popen, request: dict) -> None:
        self.server = server
        self.returncode: int | None = None
        server.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        server.stdin.flush()  # type: ignore[union-attr]
        self.pid = int(json.loads(server.stdout.readline())["pid"])  # type: ignore[union-attr]

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self.server.stdout], [], [], 0)
            if ready:
                line = self.server.stdout.readline()  # type: ignore[union-attr]
                self.returncode = int(json.loads(line)["code"]) if line else -1
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _stop(proc: Any, grace: float = 5.0) -> None:
    """SIGINT, then SIGKILL after ``grace`` seconds (a torchrun launcher gives its workers 30 s
    to finish: it gets longer, or they outlive it)."""
    with contextlib.suppress(OSError):
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _load(path: Path) -> Trace | None:
    try:
        return Trace.from_json(path.read_text(encoding="utf-8"))
    except Exception:  # a re-run killed mid-write, or none written: judged as no report
        return None


# ----------------------------------------------------------------------------- the pool


@dataclass
class _Task:
    label: str  # what the console calls it: "control", "fp32", "fix 2"
    fixes: list[str]
    out: Path
    done: Any  # callback(task, code, tail, timed_out, seconds) -> True to stop the batch
    started: float = 0.0
    child: Any = None
    slot: int = -1
    deadline: float = 0.0
    env: dict[str, str] = field(default_factory=dict)  # more of the re-run's environment


class _Pool:
    """Re-runs in parallel, ``jobs`` at a time, each slot with its own fork server; every
    re-run stops at the horizon (``--max-steps``) or at the budget's end."""

    def __init__(self, cfg: RerunConfig, jobs: int, steps: int, progress: _Progress,
                 deadline: float) -> None:
        self.cfg, self.jobs, self.steps, self.progress = cfg, jobs, steps, progress
        self.deadline = deadline
        self.servers: list[_Server | None] = [None] * jobs
        # before a stopped re-run is killed
        self.grace = cfg.stop_grace or (40.0 if cfg.processes else 5.0)
        self.startup = 0.0
        self.durations: list[float] = []

    def _server(self, slot: int) -> _Server | None:
        if self.cfg.nproc:
            return None  # a torchrun job: a fresh launcher per re-run
        server = self.servers[slot]
        if server is None:
            server = self.servers[slot] = _Server(self.cfg)
        return server

    def estimate(self) -> float:
        """About how long the next re-run takes: the slowest one so far."""
        return max(self.durations, default=0.0)

    def run(self, tasks: list[_Task], not_run: Any) -> None:
        """Run ``tasks``; ``not_run(task, why)`` for each the budget or a stop left out."""
        queue = list(tasks)
        running: list[_Task] = []
        stopped = False
        try:
            while queue or running:
                while queue and len(running) < self.jobs and not stopped:
                    task = queue.pop(0)
                    now = time.monotonic()
                    if now + 0.5 * self.estimate() > self.deadline:
                        not_run(task, "the --budget was spent")
                        continue
                    slot = next(i for i in range(self.jobs)
                                if all(t.slot != i for t in running))
                    task.slot, task.started, task.deadline = slot, now, self.deadline
                    task.child = _start_child(self.cfg, self._server(slot), task.fixes,
                                              task.out, self.steps, task.env)
                    running.append(task)
                if stopped:
                    for task in queue:
                        not_run(task, "")
                    queue = []
                for task in list(running):
                    timed_out = False
                    if task.child.poll() is None:
                        if time.monotonic() > task.deadline:
                            _stop(task.child, self.grace)
                            timed_out = True
                        else:
                            continue
                    running.remove(task)
                    seconds = round(time.monotonic() - task.started, 2)
                    self.durations.append(seconds)
                    code = task.child.returncode if task.child.returncode is not None else -1
                    log = task.out / "output.txt"
                    tail = log.read_text(encoding="utf-8", errors="replace")[-2000:] \
                        if log.exists() else ""
                    if task.done(task, code, tail, timed_out, seconds):
                        stopped = True
                        for other in running:  # a fix was verified: the rest are moot
                            _stop(other.child, self.grace)
                            shutil.rmtree(other.out / "files", ignore_errors=True)
                            not_run(other, "")
                        running = []
                        break
                if running:
                    last = _last_progress(running[0].out / "progress.txt")
                    names = ", ".join(t.label for t in running)
                    self.progress.live(f"nanhunt  re-running: {names}" +
                                       (f"  {last}" if last else ""))
                    time.sleep(0.05)
        except KeyboardInterrupt:
            for task in running:
                _stop(task.child, self.grace)
                shutil.rmtree(task.out / "files", ignore_errors=True)
            raise

    def close(self) -> None:
        for server in self.servers:
            if server is not None:
                server.close()


def _start_child(cfg: RerunConfig, server: _Server | None, fixes: list[str], out: Path,
                 steps: int, extra: dict[str, str] | None = None) -> Any:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(cfg.env, **(extra or {}), NANHUNT_RERUN="1", WANDB_MODE="disabled",
               NANHUNT_SCRATCH=str((out / "files").resolve()),
               NANHUNT_PROGRESS=str((out / "progress.txt").resolve()))
    log_path = out / "output.txt"
    argv = _child_command(cfg, fixes, out.resolve(), steps)
    if server is not None and server.proc is not None and server.proc.poll() is None:
        return _Forked(server.proc, {"argv": argv[3:], "cwd": cfg.cwd, "env": env,
                                     "log": str(log_path.resolve())})
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, cwd=cfg.cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


# ----------------------------------------------------------------------------- the search

#: the conditions of "verified", in the order the report says them
CONDITIONS = ("control_reproduced", "past_horizon", "finite", "no_skip_streak",
              "learned", "within_fp32_noise")


def default_jobs() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def verify_by_rerun(trace: Trace, cfg: RerunConfig, out_dir: Path) -> None:
    """Diagnose by experiment and verify the recommendations by re-running the script: a
    control, the ladder's rungs, then each candidate fix (narrowest first)."""
    v = trace.verification = Verification(tries_allowed=cfg.tries,
                                          script_seconds=cfg.script_seconds)
    # a torchrun job's re-runs take its processes each: one at a time
    jobs = 1 if cfg.processes else cfg.jobs or default_jobs()
    ex = trace.experiments = Experiments(jobs=jobs)
    for rec in trace.recommendations:
        rec.verified = False
    if trace.run.status == "interrupted":
        why = "terminated (SIGTERM)" if trace.run.error == "SIGTERM" else "interrupted (Ctrl-C)"
        v.note = f"not re-run: the run was {why}"
        ex.source = "rules"
        ex.note = f"the run was {why}: no experiment was started; the verdict is the rules' alone"
        _label_untried(trace, f"not verified: the run was {why}")
        return
    if cfg.tries <= 0:
        v.note = "re-run verification is off (--verify 0)"
        ex.source = "rules"
        ex.note = "experiments are off (--verify 0): the verdict is the rules' alone"
        _label_untried(trace, "not verified: re-run verification is off (--verify 0)")
        return
    silent = silent_candidate(trace)
    if not trace.problem and not silent:
        v.note = "nothing to verify: no problem was found"
        trace.experiments = None
        return
    if trace.run.world_size > 1 and cfg.processes != trace.run.world_size:
        why = cfg.not_rerun or "nanhunt does not know how to start it again"
        v.note = f"not re-run: this {trace.run.world_size}-process job: {why}"
        ex.source, ex.note = "rules", (f"no experiment ran for this {trace.run.world_size}-"
                                       f"process job ({why}): the verdict is the rules' alone")
        _label_untried(trace, v.note)
        return
    if trace.run.status == "crashed" and trace.first_failure is None:
        v.note = "the script raised an exception before any value went non-finite: not re-run"
        ex.source = "rules"
        ex.note = ("the script raised an exception before any value went non-finite: no "
                   "experiment re-runs a crash; the verdict is the rules' alone")
        _label_untried(trace, "not verified: " + v.note)
        return
    if silent:
        # no problem found: compare the whole run with float32 everywhere (a silent failure)
        steps = len(trace.steps) if not cfg.max_steps else min(len(trace.steps),
                                                                  cfg.max_steps)
        v.target_steps = ex.horizon = steps
    else:
        ex.failure_step = failure_step(trace)
        steps = v.target_steps = ex.horizon = horizon(ex.failure_step, trace, cfg.max_steps)
    budget = cfg.budget if cfg.budget is not None else max(
        BUDGET_MIN, BUDGET_FACTOR * (cfg.script_seconds or 10.0))
    v.budget_seconds = ex.budget_seconds = round(budget, 2)
    candidates = verify_order(trace.recommendations)
    first = first_rungs(trace) + (suspect_rungs(trace, steps) if silent else [])
    if silent:
        compared = [{"fp32": "float32 everywhere", "warmup": "a learning-rate warm-up"}[r.name]
                    for r in first if r.name != "control"]
        v.note = ("no problem was found: the run was compared with " + " and ".join(compared)
                  if compared else "no rule explained the loss's blow-up: the script was re-run "
                  "unchanged to check it")
    progress = _Progress(cfg.quiet)
    progress.say(
        f"nanhunt: diagnosing by experiment: re-running the script (a control, the experiment "
        f"ladder, up to {cfg.tries} fixes), {steps} steps each, {jobs} at a time (--verify 0 "
        "turns this off)" if not silent else
        f"nanhunt: no failure found; re-running the script {len(first)} times ("
        + ", ".join(r.name if r.name != "fp32" else "float32 everywhere" for r in first)
        + f"), {steps} steps each (--verify 0 turns this off)")
    scratch = out_dir / RERUN_DIR
    shutil.rmtree(scratch, ignore_errors=True)
    start = time.monotonic()
    pool = _Pool(cfg, jobs, steps, progress, start + budget)
    winner: list[Recommendation] = []
    control: list[Experiment] = []

    def not_run(task: _Task, why: str) -> None:
        if why:
            ex.not_run.append(f"{task.label} (--fix {' --fix '.join(task.fixes)})"
                              if task.fixes else task.label)

    reruns: dict[str, tuple[Experiment, Trace | None, int, str]] = {}

    used: dict[str, int] = {}  # re-run folders by rung name

    def rung_task(rung: Rung, folder: str | None = None) -> _Task:
        e = Experiment(rung=rung.name, fixes=list(rung.fixes), purpose=rung.purpose,
                       target_steps=steps)

        def done(task: _Task, code: int, tail: str, timed_out: bool, seconds: float) -> bool:
            rerun = _load(task.out / "report.json")
            outcome(e, trace, rerun, exit_code=code, output_tail=tail, timed_out=timed_out)
            reruns[" ".join(rung.fixes)] = (e, rerun, code, tail)
            e.seconds = seconds
            e.report = str(task.out.relative_to(out_dir) / "report.json")
            ex.runs.append(e)
            _finish(task.out, v)
            progress.say(f"nanhunt: experiment {rung.name}"
                         + (f" (--fix {' --fix '.join(rung.fixes)})" if rung.fixes else "")
                         + f": {_said(e)}")
            return False

        if folder is None:  # rungs of one name (the source rung's lines) in folders of their own
            used[rung.name] = used.get(rung.name, 0) + 1
            folder = rung.name if used[rung.name] == 1 else f"{rung.name}-{used[rung.name]}"
        label = rung.name
        if rung.name == "lines" and rung.fixes:  # which lines: two run at once
            label = "lines " + rung.fixes[0].rpartition(":")[2]
        task = _Task(label, list(rung.fixes), scratch / folder, done)
        if rung.name == "control" and ex.failure_step is not None and not cfg.processes:
            # the control's failing step watched op by op: the op and line of a failure
            # outside every module (a hand-written loss), which no module replay can name
            task.env["NANHUNT_LOCATE_STEP"] = str(ex.failure_step)
        return task

    def fix_task(rec: Recommendation, fixes: list[str]) -> _Task:
        n = len([t for t in tasks_made if t.label.startswith("fix")]) + 1

        def done(task: _Task, code: int, tail: str, timed_out: bool, seconds: float) -> bool:
            rerun = _load(task.out / "report.json")
            result = judge(trace, rerun, steps, exit_code=code, output_tail=tail)
            if timed_out:
                result.verified = False
                result.reason = (f"stopped at the --budget's end ({result.steps} steps run)")
            e = outcome(Experiment(rung="fix", fixes=list(fixes), target_steps=steps,
                                   purpose=f"does the {rec.type} fix train?"),
                        trace, rerun, exit_code=code, output_tail=tail, timed_out=timed_out)
            _conditions(result, e, ex)
            result.fixes = list(fixes)
            result.seconds = e.seconds = seconds
            result.report = e.report = str(task.out.relative_to(out_dir) / "report.json")
            v.tries += 1
            rec.tries.append(result)
            ex.runs.append(e)
            _finish(task.out, v)
            progress.say(f"nanhunt: re-run {task.label} --fix {' --fix '.join(fixes)}: "
                         + ("verified: " if result.verified else "not verified: ")
                         + result.reason)
            if result.verified and not any(w.data.get("source") != "bisection"
                                           for w in winner):
                winner.append(rec)
                set_fix(rec, trace, [parse_fix(s) for s in fixes])
                return True
            return False

        task = _Task(f"fix {n}", list(fixes), scratch / f"try-{n}", done)
        tasks_made.append(task)
        return task

    def reused(fixes: list[str], ran: tuple) -> FixTry:
        """A fix an experiment rung installed already (lr-factor=0.1, clip=...): judged from
        that re-run, not run twice."""
        e, rerun, code, tail = ran
        result = judge(trace, rerun, steps, exit_code=code, output_tail=tail)
        if e.outcome == "stopped":
            result.verified = False
        _conditions(result, e, ex)
        result.fixes, result.report = list(fixes), e.report
        result.reason += f" (the {e.rung} experiment's re-run)"
        return result

    def reuse(rec: Recommendation, fixes: list[str], ran: tuple) -> bool:
        """Record a rung's re-run as a try of ``rec``; True when it is the first verified."""
        result = reused(fixes, ran)
        rec.tries.append(result)
        if result.verified and not any(w.data.get("source") != "bisection" for w in winner):
            winner.append(rec)
            set_fix(rec, trace, [parse_fix(s) for s in fixes])
            return True
        return False

    tasks_made: list[_Task] = []
    excluded: dict[int, str] = {}  # id(recommendation) -> why it was not re-run
    try:
        pool.run([rung_task(r) for r in first], not_run)
        control_facts(ex, trace)
        if ex.control_reproduced:
            _adopt_located(trace, scratch / "control" / "located.json", ex)
        control = [e for e in ex.runs if e.rung == "control"]
        if silent:
            finding = silent_verdict(ex, trace)
            if finding is None and trace.diagnosis is None:
                finding = warmup_verdict(ex, trace)
                if finding is not None:
                    _warmup_recommendation(trace, ex, finding)
            if finding is not None:
                if trace.diagnosis is None:
                    trace.diagnosis = finding
                trace.problem = True
            if ex.verdict == "not-precision":  # it diverges in float32 too: the optimizer?
                rungs = [r for r in next_rungs(trace, ex) if r.name.startswith("lr-")]
                pool.run([rung_task(r) for r in rungs], not_run)
                for e in ex.runs:  # the original's scaler cycles are not the rungs' failure
                    excuse_cycles(e, trace)
                # the smaller change first, a re-run that learned and made no failure of its
                # own before one that only stayed finite
                trained = [e for name in ("lr-0.1", "lr-0.01") for e in ex.runs
                           if e.rung == name and e.outcome == "trained"]
                lr = next((e for e in trained if _learned_cleanly(e)), None)
                if lr is not None:
                    ex.verdict = "optimisation"
                    ex.verdict_text += f"; a learning rate x{lr.fixes[0].split('=')[1]} " \
                        "trains and learns: an optimisation failure (the learning rate)"
                    _lr_rung_recommendation(trace, ex, lr, finding)
                else:
                    if trained:
                        ex.verdict_text += "; " + " and ".join(
                            f"a learning rate x{e.fixes[0].split('=')[1]}" for e in trained) \
                            + " stayed finite but did not learn or failed otherwise (" + \
                            "; ".join(e.detail for e in trained) + ")"
                    # no learning rate tames it: was it one batch? (the step it diverged at,
                    # and the one before, whose update the loss of that step shows)
                    pool.run([rung_task(r) for r in divergence_batch_rungs(ex)], not_run)
                    for e in ex.runs:
                        excuse_cycles(e, trace)
                    batch = cured_batch(ex, check=_learned_cleanly)
                    if batch is not None:
                        _batch_rung_recommendation(trace, ex, batch, finding)
                    else:
                        tried = batch_runs(ex)
                        if tried:
                            ex.verdict_text += "; " + batches_said(
                                tried, _learned_cleanly,
                                "; ".join(f"{e.outcome}: {e.detail}" for e in tried))
        elif ex.control_reproduced:
            rungs = [rung_task(r) for r in next_rungs(trace, ex)]
            fp32 = next((e for e in ex.runs if e.rung == "fp32"), None)
            if cured(fp32, ex):
                # a precision failure: bisect float32 over the module tree, its first level
                # beside the other rungs
                region = _bisect(trace, ex, pool, rungs, rung_task, not_run, reruns, steps)
                for made in (_master_recommendation(trace, ex),
                             _lines_recommendation(trace, ex)):
                    if made is not None and made not in candidates:
                        candidates = verify_order([*candidates, made])
                if region is not None and region.tries[-1].verified:
                    winner.append(region)
                    # only the rules' fixes likelier to cure than a float32 region (a floor, an
                    # eps) are still worth a re-run
                    candidates = [r for r in candidates if cure_rank(r) < cure_rank(region)]
            else:
                pool.run(rungs, not_run)
                if fp32 is not None and (fp32.outcome in ("recurred", "moved", "diverged")
                                         or unlearned(fp32, ex)):
                    # float32 everywhere is the widest float32 change: no narrower one can cure
                    for rec in candidates:
                        if rec.type in _FLOAT32_TYPES:
                            how = "it did not learn" if unlearned(fp32, ex) else fp32.outcome
                            excluded[id(rec)] = (f"float32 everywhere did not remove the "
                                                 f"failure ({how}), so no narrower float32 "
                                                 "change can")
                    candidates = [r for r in candidates if id(r) not in excluded]
            _adopt_lr_rung(trace, ex)
            made = _adopt_batch_rung(trace, ex)
            if made is not None and made not in candidates:
                candidates = verify_order([*candidates, made])
            # candidates in order of cure: a fix a rung already ran is read again, free; the
            # first of those that trained ends the list, but the likelier cures queued before
            # it still run first and win if they train (a warm-up before "lr x0.1")
            fixes: list[_Task] = []
            again: list[tuple[Recommendation, list[str], tuple]] = []
            for rec in candidates:
                found = False
                for rung in ladder(rec, trace):
                    if " ".join(rung) in reruns:  # a rung ran this fix already: read it again
                        again.append((rec, rung, reruns[" ".join(rung)]))
                        found = reused(rung, again[-1][2]).verified
                    elif len(fixes) < cfg.tries:
                        fixes.append(fix_task(rec, rung))
                    if found:
                        break
                if found:
                    break
            pool.run(fixes, not_run)
            for rec, rung, ran in again:
                reuse(rec, rung, ran)
    except KeyboardInterrupt:
        v.interrupted = ex.interrupted = True
        v.note = "re-run verification was interrupted (Ctrl-C); what it found so far is kept"
        progress.say("nanhunt: " + v.note)
    finally:
        pool.close()
        progress.clear()
        v.seconds = ex.seconds = round(time.monotonic() - start, 2)
    ex.source = "experiments" if control else "rules"
    if not control:
        ex.note = ("the control did not run (" + ("Ctrl-C" if ex.interrupted else "the budget")
                   + "): the verdict is the rules' alone")
    if not silent:
        classify(ex, trace)
    if ex.not_run and not v.note:
        v.note = f"the --budget ({budget:.0f} s) was spent: {len(ex.not_run)} re-run" + \
            ("s" if len(ex.not_run) != 1 else "") + " did not run"
    if silent:
        return
    if ex.control_reproduced is False:
        _label_not_reproduced(trace, ex)
        return
    _label(trace, winner, v, excluded)


def _bisect(trace: Trace, ex: Experiments, pool: _Pool, first: list[_Task], rung_task: Any,
            not_run: Any, reruns: dict, steps: int) -> Recommendation | None:
    """The region rung (:mod:`nanhunt.experiment.region`): its first level runs with ``first``
    (the rungs float32's outcome called for), each later level after the one before. Its result
    is ``ex.region`` and a recommendation judged like any fix (None when no region trained)."""
    b = Bisection.of(trace)
    batch = list(first)
    n = 0
    while True:
        proposals = b.propose()
        if not proposals:
            break
        tasks = []
        for patterns in proposals:
            n += 1
            fix = region_spec(patterns, b.keep)
            tasks.append(rung_task(Rung("region", (fix,), "does float32 for "
                                        + ", ".join(patterns) + " alone remove the failure?"),
                                   folder=f"region-{n}"))
        if pool.jobs >= len(tasks) + len(batch):
            pool.run(batch + tasks, not_run)
        else:  # fewer slots than regions: the likelier first, the other only where it failed
            pool.run(batch + tasks[:1], not_run)
            first_won = reruns.get(tasks[0].fixes[0], (None,))[0]
            if first_won is None or first_won.outcome != "trained":
                pool.run(tasks[1:], not_run)
        batch = []
        ran = {t.fixes[0]: reruns[t.fixes[0]][0].outcome for t in tasks
               if t.fixes[0] in reruns}
        won = "trained" in ran.values()
        b.record({t.fixes[0]: ran.get(t.fixes[0], "skipped" if won else "not run")
                  for t in tasks})
    if batch:
        pool.run(batch, not_run)
    if b.region is None:
        ex.region_text = b.text()
        return None
    fix = region_spec(b.region, b.keep)
    ex.region = fix
    e, rerun, code, tail = reruns[fix]
    result = judge(trace, rerun, steps, exit_code=code, output_tail=tail)
    _conditions(result, e, ex)
    result.fixes, result.seconds, result.report = [fix], e.seconds, e.report
    rec = next((r for r in trace.recommendations if r.type == "fp32_module" and
                r.fix == [fix]), None)
    if rec is None:
        rec = Recommendation(
            type="fp32_module", value=b.region[0] if len(b.region) == 1 else list(b.region),
            snippet="", module=b.region[0] if len(b.region) == 1 else None,
            evidence=[f"the smallest float32 region the bisection found: {b.runs} re-runs "
                      "over the module tree, each half of the modules in float32 in turn"],
            data={"source": "bisection", "modules": list(b.region),
                  "cast_to": None if b.keep else trace.run.target})
        set_fix(rec, trace, [parse_fix(fix)])
        trace.recommendations.append(rec)
    rec.tries.append(result)
    return rec


_OUTCOME_WORDS = {"recurred": "failure recurred", "moved": "failure moved",
                  "trained": "trained", "diverged": "diverged", "crashed": "crashed",
                  "stopped": "stopped"}


def _said(e: Experiment) -> str:
    """An experiment's outcome and what showed it, without saying the outcome twice."""
    words = _OUTCOME_WORDS.get(e.outcome, e.outcome)
    if e.detail.lower().startswith(("the " + words, words)):
        return e.detail
    return f"{words}: {e.detail}"


def _conditions(result: FixTry, e: Experiment, ex: Experiments) -> None:
    """Fill which conditions of "verified" held; verified only when every one did."""
    fp32 = next((x for x in ex.runs if x.rung == "fp32" and cured(x, ex)), None)
    c: dict[str, bool | None] = {
        "control_reproduced": bool(ex.control_reproduced),
        "past_horizon": e.steps >= e.target_steps or (e.ended and ex.failure_step is not None
                                                       and e.steps > ex.failure_step),
        "finite": e.outcome not in ("recurred", "moved", "crashed", "stopped") and
        not (e.outcome == "diverged" and "loss" in e.detail and "blew" not in e.detail),
        "no_skip_streak": "skipped" not in e.detail,
        "learned": None,
        "within_fp32_noise": None,
    }
    if e.outcome == "trained":
        learned = learning(e, ex)
        if learned is not None:
            c["learned"] = learned[0]
            if not learned[0]:
                result.reason += "; " + learned[1]
    if fp32 is not None and e.outcome == "trained":
        gap = loss_gap(e, fp32, ex, None)
        if gap is not None:
            c["within_fp32_noise"] = gap[0] <= gap[1]
            if not c["within_fp32_noise"]:
                result.reason += (f"; its loss is {gap[0]:.3g} above the float32 experiment's "
                                  f"(noise {gap[1]:.3g})")
    result.conditions = c
    result.verified = bool(result.verified and all(v is not False for v in c.values()))
    if not c["control_reproduced"]:
        result.verified = False
    if result.verified:
        held = [k.replace("_", " ") for k in CONDITIONS if c.get(k)]
        result.reason += "; held: " + ", ".join(held)


def _master_recommendation(trace: Trace, ex: Experiments) -> Recommendation | None:
    """The float32-master-weights fix where its rung trained: the rules' recommendation of it,
    or one made from the experiment where no rule proposed it (its re-run is then read again as
    its try, like any rung's)."""
    e = next((x for x in ex.runs if x.rung == "fp32-master" and cured(x, ex)), None)
    if e is None:
        return None
    rec = next((r for r in trace.recommendations if r.fix == ["fp32-master"]), None)
    if rec is None:
        groups = sorted({d for o in trace.optimizers for d in o.param_dtypes
                         if d in ("float16", "bfloat16")})
        rec = Recommendation(
            type="fp32_master_weights", value=None, snippet="",
            evidence=[f"the optimizer steps {' and '.join(groups)} weights: its update and its "
                      "state are rounded to that format; with float32 master copies the re-run "
                      f"trained ({e.detail})"],
            data={"source": "experiment"})
        set_fix(rec, trace, [parse_fix("fp32-master")])
        trace.recommendations.append(rec)
    return rec


def _rung_recommendation(trace: Trace, ex: Experiments, e: Experiment, type_: str, value: Any,
                         evidence: list[str], why: str) -> Recommendation:
    """A recommendation made from an experiment rung of a run with no failure found (a warm-up,
    a lower learning rate), whose try is that rung's re-run: verified where the control,
    unfixed, showed the problem again (``why``: how), the rung's re-run ran every step with
    finite losses and no skip streak, and its loss fell."""
    rec = Recommendation(type=type_, value=value, snippet="", evidence=evidence,
                         data={"source": "experiment"})
    set_fix(rec, trace, [parse_fix(s) for s in e.fixes])
    drop = _drop(e.losses)
    result = FixTry(fixes=list(e.fixes), verified=True, steps=e.steps,
                    target_steps=e.target_steps, losses=list(e.losses), seconds=e.seconds,
                    report=e.report,
                    reason=(f"{why}; the re-run with --fix {' --fix '.join(e.fixes)} ran "
                            f"{e.steps} of {e.target_steps} steps, its loss "
                            f"{loss_span(e.losses)}"))
    result.conditions = {"control_reproduced": bool(ex.control_reproduced),
                         "past_horizon": e.steps >= e.target_steps,
                         "finite": e.outcome == "trained", "no_skip_streak":
                         "skipped" not in e.detail,
                         "learned": drop is not None and drop > 0
                         and "its own diagnosis" not in e.detail,
                         "within_fp32_noise": None}
    result.verified = all(v is not False for v in result.conditions.values())
    rec.tries.append(result)
    rec.check = "rerun"
    rec.verified = result.verified
    held = ", ".join(k.replace("_", " ") for k in CONDITIONS if result.conditions.get(k))
    failed = ", ".join(k.replace("_", " ") for k in CONDITIONS
                       if result.conditions.get(k) is False)
    rec.verification = ("verified by re-run: " + result.reason + "; held: " + held
                        if rec.verified else
                        "not verified: " + result.reason + "; did not hold: " + failed)
    trace.recommendations.insert(0, rec)
    return rec


def _warmup_recommendation(trace: Trace, ex: Experiments, finding: Finding) -> None:
    """The warm-up that its experiment showed the run learns more with."""
    e = next(x for x in ex.runs if x.rung == "warmup")
    control = next(x for x in ex.runs if x.rung == "control")
    # the control showed the original's curve again: the same losses, or within half the
    # warm-up's gain of them (its difference from the original cannot make up the gain)
    ex.control_reproduced = bool(ex.deterministic or (
        ex.spread is not None and ex.spread <= finding.data["gap"] / 2))
    like = ("its losses are the original run's" if ex.deterministic else
            f"within {ex.spread:.3g} of the original run's losses" if ex.spread is not None else
            "not compared with the original run's losses")
    _rung_recommendation(
        trace, ex, e, "lr_warmup", finding.data.get("warmup"),
        [finding.evidence[-1], "a post-LN transformer needs a warm-up to train at its full "
         "learning rate (Xiong et al. 2020); longer runs: about 2 / (1 - beta2) steps for Adam "
         "(Ma & Yarats 2021)"],
        f"the control, unfixed, ran {control.steps} steps and learned less ({like})")


def _learned_cleanly(e: Experiment) -> bool:
    """A rung of a run with no failure found that trained, learned (its loss fell) and made no
    failure of its own."""
    d = _drop(e.losses)
    return e.outcome == "trained" and "its own diagnosis" not in e.detail and \
        d is not None and d > 0


def _lr_rung_recommendation(trace: Trace, ex: Experiments, e: Experiment,
                            finding: Finding | None) -> None:
    """A lower learning rate where the run diverged with nothing non-finite and the lr rung
    trained: the finding is the learning rate's, its fix that rung's."""
    value = e.fixes[0].split("=", 1)[1]
    factor = float(value)
    control = next(x for x in ex.runs if x.rung == "control")
    said = (f"a learning rate x{value} trains ({e.detail}) where the control diverged again "
            f"({control.detail})")
    if finding is not None and finding.kind == "divergence":
        finding.kind = "lr_too_high"
        finding.phase = "optimizer"
        finding.evidence.append(said + ": the learning rate")
    _rung_recommendation(trace, ex, e, "lower_lr", factor, [said],
                         f"the control, unfixed, diverged again ({control.detail})")


#: the advice of a data fix made from a batch rung
_LOOK_AT_IT = ("look at that batch: an outlier, a corrupt record, values in other units, labels "
               "out of range; skip or clean it")


def _batch_rung_recommendation(trace: Trace, ex: Experiments, e: Experiment,
                               finding: Finding | None) -> None:
    """One batch where the run diverged with nothing non-finite and no learning rate tamed it,
    but replacing that batch (by the one before) trains and learns: a data failure, its fix
    that rung's."""
    step = int(rung_value(e))
    control = next(x for x in ex.runs if x.rung == "control")
    said = (f"with step {step}'s batch replaced by step {step - 1}'s the re-run trains and "
            f"learns ({e.detail}) where the control diverged again ({control.detail})")
    ex.verdict = "data"
    ex.verdict_text += f"; {said}: a data failure (the batch of step {step})"
    if finding is not None and finding.kind == "divergence":
        finding.kind, finding.phase, finding.step = "bad_input", "data", step
        finding.message = (f"the training diverged at the batch of step {step}: "
                           f"{control.detail}")
        finding.evidence.append(said)
    _rung_recommendation(
        trace, ex, e, "fix_data", {"step": step},
        [said, _LOOK_AT_IT],
        f"the control, unfixed, diverged again ({control.detail})")


def _adopt_batch_rung(trace: Trace, ex: Experiments) -> Recommendation | None:
    """Where replacing one batch removed the failure and neither float32, a lower learning rate
    nor replacing the batch's named samples did, the data fix is that batch skipped: the rules'
    fix_data of that step takes the rung's spec, or a recommendation is made from the rung; the
    candidates loop then reads the rung's re-run as its try."""
    # the verdict's precedence (classify): float32, the named samples, the lr, clipping first
    if any(cured(e, ex) for e in ex.runs if e.rung in ("fp32", "skip-samples", "clip") or
           e.rung.startswith("lr-")):
        return None
    e = cured_batch(ex)  # the earliest, where specific
    if e is None:
        return None
    step = int(rung_value(e))
    rec = next((r for r in trace.recommendations if r.type == "fix_data" and not r.fix and
                isinstance(r.value, dict) and r.value.get("step") == step), None)
    if rec is None:
        control = next((x for x in ex.runs if x.rung == "control"), None)
        rec = Recommendation(
            type="fix_data", value={"step": step}, snippet="",
            evidence=[f"with step {step}'s batch replaced by step {step - 1}'s the re-run "
                      f"trained ({e.detail})"
                      + (f" where the control failed again ({control.detail})"
                         if control is not None else ""),
                      _LOOK_AT_IT],
            module=None, data={"source": "experiment"})
        trace.recommendations.append(rec)
    set_fix(rec, trace, [parse_fix(e.fixes[0])])
    return rec


def _lines_recommendation(trace: Trace, ex: Experiments) -> Recommendation | None:
    """The source rung's cure: float32 for the ops written on the narrowest lines whose rung
    trained (``ex.lines``), as a recommendation whose try is that rung's re-run."""
    trained = [e for e in lines_runs(ex) if cured(e, ex)]
    if not trained:
        return None
    e = trained[0]  # the narrowest
    ex.lines = e.fixes[0]
    rec = next((r for r in trace.recommendations if r.fix == [ex.lines]), None)
    if rec is None:
        rec = Recommendation(
            type="fp32_lines", value=ex.lines.removeprefix("fp32-lines:"), snippet="",
            evidence=[f"the control re-run, watched op by op, saw the first non-finite value "
                      f"made by an op written at {ex.source_line}; with the ops written on "
                      f"those lines in float32 (autocast off, 16-bit inputs cast up; the "
                      f"modules they call unchanged) the re-run trained ({e.detail})",
                      "in your code: cast that computation's inputs with .float() inside "
                      "torch.autocast(..., enabled=False), or rewrite it so float16 cannot "
                      "reach the value (log_softmax for log(softmax), a scaled matmul)"],
            data={"source": "experiment", "lines": ex.lines})
        set_fix(rec, trace, [parse_fix(ex.lines)])
        trace.recommendations.append(rec)
    return rec


def _adopt_lr_rung(trace: Trace, ex: Experiments) -> None:
    """A learning-rate recommendation takes the largest factor an lr rung trained with where
    that is less drastic than the rule's estimate (which aims an update-to-weight ratio at
    1e-3 and can ask for x1e-5 where x0.01 trains): the experiment measured it; the rung's
    re-run then verifies it."""
    trained = [e for e in ex.runs if e.rung.startswith("lr-") and cured(e, ex)
               and e.fixes]
    if not trained:
        return
    best = max(trained, key=lambda e: parse_fix(e.fixes[0]).value or 0.0)
    factor = parse_fix(best.fixes[0]).value
    if not factor:
        return
    for rec in trace.recommendations:
        if rec.type == "lower_lr" and rec.fix and isinstance(rec.value, (int, float)) and \
                rec.value < factor:
            old = f"x{rec.value:g}"
            # the estimate's own lines (its factor, the lr it led to) no longer hold
            rec.evidence = [e for e in rec.evidence if not e.startswith(old) and
                            not (e.startswith("lr ") and "->" in e)]
            rec.evidence.append(f"lr x{factor:g}, the largest factor the experiments tried that "
                                f"trained ({best.rung}), instead of the estimate {old} from the "
                                "update-to-weight ratio")
            set_fix(rec, trace, [parse_fix(best.fixes[0])])


def _adopt_located(trace: Trace, path: Path, ex: Experiments) -> None:
    """Where nanhunt named no op for the first failure (made outside every module, as in a
    loss written by hand), the op the control re-run saw make it, watched op by op at that
    step (``located.json``; :class:`nanhunt.replay.ops.StepLocator`), and the user's line.
    An op written on the user's line itself (not inside a module) gives the source rung its
    line (``ex.source_line``)."""
    f = trace.first_failure
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if f is None or found.get("step") != f.step or not found.get("op"):
        return
    if found.get("direct") and found.get("source"):
        ex.source_line = str(found["source"])
    if f.op:
        return
    f.op = found["op"]
    if found.get("source") and not f.source:
        f.source, f.source_line = found["source"], found.get("source_line")
    inputs = []
    if isinstance(found.get("input_amax"), (int, float)):
        inputs.append(f"their largest magnitude {found['input_amax']:.3g}")
    if found.get("input_zeros"):
        inputs.append(f"{found['input_zeros']} exact zeros")
    said = [f"the control re-run, watched op by op at step {f.step}, names {found['op']} "
            f"({found.get('phase')}, {found.get('dtype')})"
            + (f" at {found['source']}" if found.get("source") else "")
            + " as the first op to make a non-finite value from finite inputs"
            + (f" ({', '.join(inputs)})" if inputs else "")]
    if found["op"] in ("aten.log", "aten.log2", "aten.log10") and found.get("input_zeros"):
        said.append(f"its input held exact zeros, so log gave -inf: probabilities that round to 0 "
                    f"in {found.get('dtype')}; compute the loss from logits (log_softmax, "
                    "cross_entropy), which never takes log(0), or clamp the probabilities first")
    if trace.diagnosis is not None:
        trace.diagnosis.evidence.extend(said)
    else:
        trace.notes.extend(said)


def _finish(out: Path, v: Verification) -> None:
    _collect_redirects(out, v)
    shutil.rmtree(out / "files", ignore_errors=True)  # what the script wrote


def _label_not_reproduced(trace: Trace, ex: Experiments) -> None:
    for rec in trace.recommendations:
        rec.verified = False
        rec.verification = ("not verified: the failure did not recur in an unfixed re-run "
                            "(control), so no re-run can show a fix works")


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


#: recommendations that keep something in float32: never re-run where float32 everywhere failed
_FLOAT32_TYPES = ("fp32_module", "fp32_lines", "fp32_master_weights")


def _label(trace: Trace, winners: list[Recommendation], v: Verification,
           excluded: dict[int, str] | None = None) -> None:
    winner = winners[0] if winners else None
    for rec in trace.recommendations:
        if excluded and id(rec) in excluded and not rec.tries:
            rec.verification = f"not verified: not re-run ({excluded[id(rec)]})"
        elif rec.tries:
            rec.check = "rerun"
            last = rec.tries[-1]
            if any(rec is w for w in winners):
                rec.verified = True
                rec.verification = "verified by re-run: " + last.reason
                if rec.data.get("source") == "bisection":
                    rec.verification += " (the region bisection's re-run)"
                elif len(rec.tries) > 1:
                    rec.verification += (f" (re-run {len(rec.tries)} of the search; narrower "
                                         "fixes did not train)")
            elif last.verified:  # it trained too, but a likelier cure was verified first
                rec.verification = ("not verified: another fix was verified first; this one's "
                                    f"re-run trained too ({last.reason})")
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
    # the verified first, the likeliest cure among them first (a float32 region before a clamp)
    trace.recommendations.sort(key=lambda r: (not r.verified, cure_rank(r) if r.verified else 0))
