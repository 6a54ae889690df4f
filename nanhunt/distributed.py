"""Distributed training (DDP under torchrun): one trace per rank, one merged report from rank 0.

Each rank runs the user's script under its own :class:`~nanhunt.capture.Hunt`, so it records its
*local* tensors: parameter-gradient hooks fire as gradients accumulate, before DDP's all-reduce
averages them. Three things tie the ranks together:

* **A symmetric stop.** When one rank finds a failure it must not leave alone: its peers would
  block in the next gradient all-reduce. At every step end each rank posts a vote in the
  rendezvous store of the user's default process group (the c10d ``Store``: TCP, no collective
  and no new process group) and waits, with a timeout, for every other rank's vote; if anyone
  wants to stop, every rank stops after that same step. A rank whose run ends (it raised, or its
  script finished) posts a "left" vote for the step it will never reach, so its peers stop at
  once instead of waiting out the timeout.
* **Rank files.** After its analysis each rank writes ``OUT/ranks/rank-<r>.json`` (a complete
  report of its own, readable with ``nanhunt report``) and, when the store is reachable, posts the
  same payload there (the only path across nodes that share no file system).
* **The merge.** Rank 0 collects every rank's trace (waiting at most ``NANHUNT_RANK_TIMEOUT``
  seconds, 60 by default) and merges them with :func:`merge_traces`: the origin is the rank whose
  first failure comes first by (step, phase order); ranks that sent nothing are named.

The merge itself is torch-free and works on hand-built traces.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanhunt.errors import NanhuntError
from nanhunt.trace import PHASES, Failure, RankSummary, Trace, needs_locating

__all__ = [
    "RANK_TIMEOUT_ENV",
    "RankContext",
    "RankResult",
    "merge_rank_files",
    "merge_traces",
    "read_rank_file",
]

#: Environment variable: seconds nanhunt waits for other ranks (votes and traces).
RANK_TIMEOUT_ENV = "NANHUNT_RANK_TIMEOUT"
_DEFAULT_TIMEOUT = 60.0
#: After SIGTERM (torchrun stopping the workers because one failed), how long rank 0 still
#: waits for missing traces: for ranks whose run has ended (they are writing), and for the others
#: (likely the killed one). torchrun sends SIGKILL 30 s after SIGTERM.
_TERM_GRACE_WRITING = 20.0
_TERM_GRACE = 2.0
_POLL = 0.05
_LAUNCHER_ENV = "NANHUNT_LAUNCHER"  # set for the workers of `nanhunt diagnose --nproc-per-node`
#: seconds rank 0 gives a re-run of the job to stop (under torchrun's 30 s to SIGKILL)
RANK0_STOP_GRACE = 15.0


def launcher_continues(trace: Trace, *, verify: bool) -> bool:
    """Whether ``nanhunt diagnose --nproc-per-node`` goes on with the merged report after the
    job: it locates a step the sentinel could not replay, and (``verify``: --verify above 0)
    runs the experiments, each a re-run of the job under torchrun."""
    from nanhunt.experiment.ladder import silent_candidate

    return needs_locating(trace) or (verify and (trace.problem or silent_candidate(trace)))


#: what torchrun sets for each of its workers: a re-run of the job under a torchrun of its own
#: must not inherit them (its launcher sets its own, and TORCHELASTIC_ERROR_FILE would make the
#: re-run's launcher write its errors where the outer job's agent reads rank 0's)
_WORKER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT")


def job_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what torchrun set for this worker (ranks, rendezvous, ``TORCHELASTIC_*``,
    and torchrun's own ``PET_*`` option defaults): the environment of a re-run of the whole job.

    >>> sorted(job_env({"RANK": "0", "TORCHELASTIC_RUN_ID": "x", "PET_NNODES": "2", "HOME": "/h",
    ...                 "OMP_NUM_THREADS": "1"}))
    ['HOME', 'OMP_NUM_THREADS']
    """
    return {k: v for k, v in env.items()
            if k not in _WORKER_ENV and not k.startswith(("TORCHELASTIC_", "PET_"))}


def process_age(pid: int) -> float | None:
    """Seconds since process ``pid`` started (Linux's /proc; None elsewhere or when unreadable).

    >>> age = process_age(os.getpid())
    >>> age is None or 0 <= age < 3600
    True
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command, which may hold ' '
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22
    except (OSError, ValueError, IndexError, AttributeError):
        return None


_META_KEY = "nanhunt_rank"  # extra top-level key of a rank file; Trace.from_dict ignores it
_ENDED = ("crashed", "interrupted")
_PHASE_ORDER = {phase: i for i, phase in enumerate(PHASES)}
#: ``RankSummary.status`` of a rank that sent no trace.
NO_ANSWER = "no answer"


# ----------------------------------------------------------------------------- merging


@dataclass
class RankResult:
    """One rank's contribution to the merged report."""

    rank: int
    trace: Trace
    ended: float | None = None  # time.time() when the rank's run ended
    run_id: str = ""


def _origin_key(ff: Failure) -> tuple[int, int]:
    return ff.step, _PHASE_ORDER.get(ff.phase, len(PHASES))


def _position(ff: Failure, order: list[str]) -> int:
    """Where in its step a failure was observed: the module's place in the forward's order
    of completion (reversed in backward, where gradients flow from the last module); an
    unknown module last."""
    if ff.module not in order:
        return len(order)
    i = order.index(ff.module)
    return len(order) - 1 - i if ff.phase == "backward" else i


def _same_place(a: Failure, b: Failure) -> bool:
    return (a.step, a.phase, a.module, a.tensor) == (b.step, b.phase, b.module, b.tensor)


def _rank_list(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {', '.join(str(r) for r in ranks)}"


def merge_traces(
    results: Iterable[RankResult], world_size: int, *, missing_reason: str = ""
) -> Trace:
    """One report from the ranks' traces.

    The base is the origin rank's trace (its timeline, modules, diagnosis and advice): the rank
    whose first failure comes first by (step, phase order data < forward < backward <
    loss_scaling < optimizer), the lowest rank on a tie. Without any failure the base is the
    lowest rank that found a problem, else the lowest rank that answered. ``ranks`` holds every
    rank, with its run's ``status`` and ``error``, and ``answered=False`` (status ``"no answer"``)
    for the ranks that sent nothing; ``missing_reason`` says why they are missing ("within
    60 s"). ``all_ranks_failed`` is set when all ``world_size`` ranks answered and failed at the
    same step, phase, module and tensor.

    >>> from nanhunt.trace import Trace
    >>> merged = merge_traces([RankResult(0, Trace()), RankResult(1, Trace())], 3)
    >>> [(r.rank, r.answered) for r in merged.ranks]
    [(0, True), (1, True), (2, False)]
    """
    answered = {res.rank: res for res in results}
    if not answered:
        raise NanhuntError("no rank sent a trace")
    failing = {
        r: res.trace.first_failure
        for r, res in sorted(answered.items())
        if res.trace.first_failure is not None
    }
    # modules in the order their forward calls completed (the same model on every rank): on a
    # tie of step and phase, the rank whose failure the step reached first is the origin
    order = [layer.module for layer in answered[min(answered)].trace.layers]
    if failing:
        base_rank = min(failing, key=lambda r: (*_origin_key(failing[r]),
                                                _position(failing[r], order), r))
    else:
        with_problem = [r for r, res in sorted(answered.items()) if res.trace.problem]
        base_rank = with_problem[0] if with_problem else min(answered)
    merged = copy.deepcopy(answered[base_rank].trace)
    merged.run.world_size = world_size
    merged.all_ranks_failed = False  # set by _name_origin
    if merged.snapshot:  # rank files name it relative to OUT/ranks
        merged.snapshot = f"ranks/{merged.snapshot}"
    merged.ranks = []
    for r in range(world_size):
        res = answered.get(r)
        if res is None:
            merged.ranks.append(RankSummary(rank=r, answered=False, status=NO_ANSWER))
            continue
        ff = copy.deepcopy(res.trace.first_failure)
        if ff is not None:
            ff.rank = r
        merged.ranks.append(
            RankSummary(
                rank=r,
                first_failure=ff,
                steps=copy.deepcopy(res.trace.steps),
                status=res.trace.run.status,
                error=res.trace.run.error,
            )
        )
    if merged.first_failure is not None:
        merged.first_failure.rank = base_rank
        _name_origin(merged, base_rank, failing, answered, world_size)
    _merge_endings(merged, answered, world_size, missing_reason)
    for r, res in sorted(answered.items()):
        if r == base_rank:
            continue
        for note in res.trace.notes:
            if note not in merged.notes:
                merged.notes.append(f"rank {r}: {note}")
    return merged


def _name_origin(
    merged: Trace,
    origin: int,
    failing: dict[int, Failure],
    answered: dict[int, RankResult],
    world_size: int,
) -> None:
    first = failing[origin]
    tied = sorted(r for r, ff in failing.items() if _origin_key(ff) == _origin_key(first))
    place = f"step {first.step}, {first.phase}"
    if (
        len(tied) > 1
        and tied == sorted(answered)
        and all(_same_place(failing[r], first) for r in tied)
    ):
        merged.all_ranks_failed = len(tied) == world_size
        who = (
            f"every rank ({world_size} of {world_size})"
            if len(tied) == world_size
            else f"every rank that answered ({len(tied)} of {world_size})"
        )
        text = f"{who} failed alike, at {first.where()}: not one rank's data or shard"
    elif len(tied) > 1:
        order = [layer.module for layer in answered[min(answered)].trace.layers]
        earlier = [r for r in tied if _position(failing[r], order) < min(
            _position(failing[q], order) for q in tied if q != r)]
        if earlier == [origin]:
            later = ", ".join(f"rank {r} at {failing[r].module or failing[r].tensor}"
                              for r in tied if r != origin)
            text = (f"{_rank_list(tied)} failed in the same step and phase ({place}), at "
                    f"different places; rank {origin}'s, at {first.module or first.tensor}, "
                    f"came first in the step ({later} after it)")
        else:
            text = (
                f"{_rank_list(tied)} failed in the same step and phase ({place}), at different "
                f"places; rank {origin}, the lowest, is shown"
            )
    else:
        others = []
        for r in sorted(answered):
            if r == origin:
                continue
            ff = failing.get(r)
            others.append(
                f"rank {r} first at step {ff.step}, {ff.phase}"
                if ff is not None
                else f"rank {r} saw none"
            )
        text = f"rank {origin} of {world_size} saw a non-finite value first ({place})"
        if others:
            text += "; " + "; ".join(others)
    assert merged.first_failure is not None
    ff = merged.first_failure
    ff.detail = f"{ff.detail} ({text})" if ff.detail else text[0].upper() + text[1:]
    if merged.diagnosis is not None:
        merged.diagnosis.evidence.insert(0, text)


def _before(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and a < b


def _merge_endings(
    merged: Trace, answered: dict[int, RankResult], world_size: int, missing_reason: str
) -> None:
    """How the run ended, over all ranks: the first rank to crash explains the others."""
    ended = sorted(
        (res for res in answered.values() if res.trace.run.status in _ENDED),
        key=lambda res: (
            res.trace.run.status != "crashed",
            res.ended if res.ended is not None else float("inf"),
            res.rank,
        ),
    )
    for i, res in enumerate(ended):  # the first to end, then the ones it took down with it
        run = res.trace.run
        what = "raised" if run.status == "crashed" else "was interrupted"
        merged.notes.append(
            f"rank {res.rank} {what}{' later' if i else ''}"
            + (f": {run.error}" if run.error else "")
        )
    if ended:
        first = ended[0]
        merged.run.status = first.trace.run.status
        error = first.trace.run.error or first.trace.run.status
        merged.run.error = f"rank {first.rank}: {error}"
        how = "raised" if first.trace.run.status == "crashed" else "was interrupted"
        for res in sorted(answered.values(), key=lambda res: res.rank):
            # a script that ends early leaves its peers blocked in the next collective
            if res.trace.run.status not in _ENDED and _before(res.ended, first.ended):
                merged.notes.append(
                    f"rank {res.rank}'s script ended ({res.trace.run.status}) after "
                    f"{len(res.trace.steps)} steps, before rank {first.rank} {how}"
                )
    missing = [r for r in range(world_size) if r not in answered]
    if missing:
        why = f" {missing_reason}" if missing_reason else ""
        verb = "sends" if len(missing) == 1 else "send"
        merged.notes.append(
            f"{_rank_list(missing)} did not answer{why}: no trace (killed, or stuck in the "
            f"training script); this report covers {_rank_list(answered)}, and the first failure "
            f"may be on a rank that {verb} nothing"
        )
        if not ended:
            merged.run.status = "crashed"
            merged.run.error = f"{_rank_list(missing)} did not answer"


# ----------------------------------------------------------------------------- rank files


def rank_file(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / "ranks" / f"rank-{rank}.json"


def _payload(result: RankResult, world_size: int) -> str:
    data = result.trace.to_dict()
    data[_META_KEY] = {
        "rank": result.rank,
        "world_size": world_size,
        "run_id": result.run_id,
        "ended": result.ended,
    }
    return json.dumps(data, indent=1, allow_nan=False)


def _parse_payload(text: str | bytes) -> RankResult:
    data = json.loads(text)
    meta = data.get(_META_KEY) if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        raise NanhuntError("not a nanhunt rank file")
    return RankResult(
        rank=int(meta["rank"]),
        trace=Trace.from_dict(data),
        ended=meta.get("ended"),
        run_id=str(meta.get("run_id", "")),
    )


def read_rank_file(path: Path) -> RankResult | None:
    """A rank file written by :class:`RankContext`, or None when it is missing or unreadable."""
    try:
        return _parse_payload(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError, NanhuntError):
        return None


def merge_rank_files(
    out_dir: Path, world_size: int, *, newer_than: float | None = None, run_id: str | None = None
) -> Trace | None:
    """Merge the rank files in ``OUT/ranks`` (files older than ``newer_than``, or of another
    run than ``run_id``, are ignored)."""
    results = []
    for r in range(world_size):
        path = rank_file(out_dir, r)
        with contextlib.suppress(OSError):
            if newer_than is not None and path.stat().st_mtime < newer_than:
                continue
        res = read_rank_file(path)
        if res is not None and res.rank == r and (run_id is None or res.run_id == run_id):
            results.append(res)
    if not results:
        return None
    return merge_traces(results, world_size, missing_reason="(no rank file)")


# ----------------------------------------------------------------------------- the live side


def _poll(ready: Callable[[], bool], timeout: float) -> bool:
    """Wait until ``ready()``, at most ``timeout`` seconds. Polling, not ``Store.wait``: a
    blocking wait in C++ would hold off Python's signal handlers (torchrun's SIGTERM) and logs
    a warning each time it times out."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while not ready():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, _POLL)
    return True


def _env_timeout() -> float:
    raw = os.environ.get(RANK_TIMEOUT_ENV)
    if not raw:
        return _DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise NanhuntError(f"{RANK_TIMEOUT_ENV} must be a number of seconds, not {raw!r}") from None
    if value <= 0:
        raise NanhuntError(f"{RANK_TIMEOUT_ENV} must be positive")
    return value


@dataclass
class RankContext:
    """This process's place in a distributed run, from torchrun's environment variables.

    The CLI creates one per process: :meth:`step_hook` makes the stop symmetric, :meth:`leave`
    tells the other ranks this one's run is over, :meth:`merge` writes the rank file and, on
    rank 0, returns the merged trace. With ``world_size == 1`` all of them do nothing.

    >>> ctx = RankContext(rank=0, world_size=1)
    >>> hook = ctx.step_hook(None)
    >>> hook is None
    True
    """

    rank: int = 0
    world_size: int = 1
    run_id: str = ""
    timeout: float = _DEFAULT_TIMEOUT
    notes: list[str] = field(default_factory=list)  # what this rank saw of the others
    ended: float | None = None
    terminated_at: float | None = None
    _store: Any = field(default=None, repr=False)
    _out_dir: Path | None = field(default=None, repr=False)
    _voted: int = -1  # the last step this rank voted on
    _voting: bool = True
    #: a worker the script started itself (torch.multiprocessing): its parent merges the ranks
    parent_merges: bool = False
    #: the parent of such workers: (number of workers, their group's run id, when they started)
    workers: tuple[int, str, float] | None = None

    @classmethod
    def from_env(cls, out_dir: Path | None = None) -> RankContext:
        """Read RANK and WORLD_SIZE; for a distributed run, remove this rank's stale rank file."""
        try:
            rank = int(os.environ.get("RANK", "0"))
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            raise NanhuntError("RANK and WORLD_SIZE must be integers") from None
        if world_size < 1 or not 0 <= rank < world_size:
            raise NanhuntError(f"RANK {rank} is not within WORLD_SIZE {world_size}")
        ctx = cls(rank=rank, world_size=world_size)
        if world_size > 1:
            ctx.timeout = _env_timeout()
            ctx.run_id = ":".join(
                os.environ.get(k, "")
                for k in (
                    "TORCHELASTIC_RUN_ID",
                    "TORCHELASTIC_RESTART_COUNT",
                    "MASTER_ADDR",
                    "MASTER_PORT",
                )
            )
            if out_dir is not None:
                with contextlib.suppress(OSError):
                    rank_file(out_dir, rank).unlink()
        return ctx

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.workers is not None

    def leaves_summary_to_launcher(self, trace: Trace, *, verify: bool) -> bool:
        """Under ``nanhunt diagnose --nproc-per-node``, a merged report the launcher goes on
        with (:func:`launcher_continues`): it prints the summary after that, not rank 0."""
        return bool(os.environ.get(_LAUNCHER_ENV)) and launcher_continues(trace, verify=verify)

    def job_reruns(self, rerun: Any, trace: Trace | None = None) -> Any:
        """How the process that writes the merged report re-runs the whole job, for the
        experiments and a locating re-run (``rerun``: the run's
        :class:`~nanhunt.experiment.verify.RerunConfig`, returned changed):

        - the parent of workers the script starts itself re-runs the script, which starts them
          again (``workers``);
        - rank 0 of a torchrun job nanhunt did not launch (``torchrun -m nanhunt diagnose``),
          where every rank runs on this machine, re-runs the job under a torchrun of its own
          (``nproc``), in an environment without this job's rendezvous (:func:`job_env`); the
          other ranks have exited by then (0 after a problem: :meth:`exit_code`);
        - a job on several machines, or one torchrun is stopping (a rank crashed, or exited with
          an error: torchrun then stops every rank, rank 0 and its re-runs included), is not
          re-run (``not_rerun`` says why);
        - under ``nanhunt diagnose --nproc-per-node`` the launcher re-runs it (unchanged).

        Rank 0's re-runs stop within :data:`RANK0_STOP_GRACE` s of a signal, under the 30 s
        torchrun gives a worker between SIGTERM and SIGKILL."""
        if self.workers is not None:
            return dataclasses.replace(rerun, workers=self.workers[0])
        if self.world_size <= 1 or os.environ.get(_LAUNCHER_ENV):
            return rerun
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None:
            why = ("it was not started by torchrun (LOCAL_WORLD_SIZE is unset), so nanhunt "
                   "cannot tell whether all its ranks run on this machine")
        elif local != str(self.world_size):
            why = (f"its {self.world_size} ranks run on several machines (LOCAL_WORLD_SIZE "
                   f"{local}); nanhunt re-runs a job only where all its ranks run on one")
        elif self.terminated_at is not None:
            why = "torchrun was stopping the job (SIGTERM) when its report was made"
        else:
            ended = [r for r in (trace.ranks if trace is not None else [])
                     if not r.answered or r.status in _ENDED]
            why = "" if not ended else (
                f"rank {ended[0].rank} " + ("did not answer" if not ended[0].answered else
                                            ended[0].status)
                + ": torchrun stops every rank once one ends with an error, rank 0 and its "
                "re-runs included (nanhunt diagnose --nproc-per-node N re-runs such a job)")
        if why:
            return dataclasses.replace(rerun, not_rerun=why)
        # the default budget is a multiple of the job's time: from torchrun's start (its agent
        # is this rank's parent), which a re-run pays again, not from this rank's
        age = process_age(os.getppid())
        seconds = max(rerun.script_seconds or 0.0, age or 0.0) or rerun.script_seconds
        return dataclasses.replace(rerun, nproc=self.world_size, env=job_env(rerun.env),
                                   stop_grace=RANK0_STOP_GRACE, script_seconds=seconds)

    @property
    def writes_report(self) -> bool:
        """This process writes the merged report: rank 0, or the parent of spawned workers."""
        return self.rank == 0 and not self.parent_merges

    def add_workers(self, nprocs: int, run_id: str, started: float, out_dir: Path) -> None:
        """The script started ``nprocs`` workers (``torch.multiprocessing``): the report is
        theirs, merged from their rank files (the last group's, when it starts several)."""
        if self.workers is not None:
            self.notes.append(
                f"the script started workers more than once; this report covers the last "
                f"{nprocs} (torch.multiprocessing)")
        self.workers = (nprocs, run_id, started)
        self._out_dir = Path(out_dir)

    def workers_stopped(self) -> bool:
        """Whether nanhunt stopped the last group of workers (a failure on some rank)."""
        if self.workers is None or self._out_dir is None:
            return False
        nprocs, run_id, _ = self.workers
        for r in range(nprocs):
            res = read_rank_file(rank_file(self._out_dir, r))
            if res is not None and res.run_id == run_id and res.trace.run.status == "stopped":
                return True
        return False

    def rank_dir(self, out_dir: Path) -> Path:
        """Where this rank's own artefacts (the culprit snapshot) go: ``OUT/ranks/rank-<r>``
        (the parent of spawned workers keeps its own in ``OUT``)."""
        if self.workers is not None:
            return Path(out_dir)
        path = Path(out_dir) / "ranks" / f"rank-{self.rank}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    # -- the symmetric stop -----------------------------------------------------------------

    def step_hook(self, inner: Callable[[Any, Any], None] | None) -> Any:
        """A ``Hunt(on_step=...)`` callback: ``inner`` (the live line), then the stop vote."""
        if not self.distributed:
            return inner

        def on_step(rec: Any, hunt: Any) -> None:
            if inner is not None:
                inner(rec, hunt)
            self._vote(rec.index, hunt)

        return on_step

    def _get_store(self) -> Any:
        if self._store is not None:
            return self._store
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return None
            # the rendezvous store the user's process group already holds: no new sockets and no
            # collective to agree on (a new process group would be one)
            base = dist.distributed_c10d._get_default_store()
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self._store = dist.PrefixStore(f"nanhunt/{restart}/", base)
        except Exception:
            return None
        return self._store

    def _vote(self, step: int, hunt: Any) -> None:
        # keep-going runs never stop early, so their ranks stay in step without a vote
        if not (self._voting and hunt.stop_on_problem):
            return
        store = self._get_store()
        if store is None:  # the script does not use torch.distributed: nothing can hang
            return
        want = hunt.first_failure is not None
        stop_key = f"v{step}/stop"
        try:
            if want:
                store.add(stop_key, 1)
            store.set(f"v{step}/{self.rank}", b"1")
            self._voted = step
            keys = [f"v{step}/{r}" for r in range(self.world_size)]
            if not _poll(lambda: store.check(keys), self.timeout):
                missing = [r for r in range(self.world_size) if not store.check([keys[r]])]
                self.notes.append(
                    f"step {step}: {_rank_list(missing) if missing else 'a rank'} did not answer "
                    f"nanhunt's step-end check within {self.timeout:g} s "
                    f"({RANK_TIMEOUT_ENV}); rank {self.rank} stopped there"
                )
                self._give_up(hunt)
                return
            stopping = int(store.add(stop_key, 0)) > 0
            if step >= 2:  # every rank has read the votes of step - 2 by now
                store.delete_key(f"v{step - 2}/{self.rank}")
                if self.rank == 0:
                    store.delete_key(f"v{step - 2}/stop")
        except Exception as exc:  # the store is gone with the process that held it
            self.notes.append(
                f"step {step}: nanhunt's step-end check failed "
                f"({type(exc).__name__}: {exc}); rank {self.rank} stopped there"
            )
            self._give_up(hunt)
            return
        if stopping:
            hunt.request_stop()

    def _give_up(self, hunt: Any) -> None:
        self._voting = False
        hunt.request_stop()

    def leave(self) -> None:
        """This rank's run is over: peers waiting for its next vote stop now, not at timeout."""
        if not self.distributed or self.ended is not None:
            return
        self.ended = time.time()
        store = self._get_store()
        if store is None:
            return
        step = self._voted + 1
        with contextlib.suppress(Exception):
            store.add(f"v{step}/stop", 1)
            store.set(f"v{step}/{self.rank}", b"L")
            store.set(f"left/{self.rank}", b"1")  # rank 0: "its trace is coming"

    def defer_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM handler while the reports are written: torchrun stops every worker once one
        fails, and gives it 30 s before SIGKILL; finish the report instead of dying mid-write."""
        if self.terminated_at is None:
            self.terminated_at = time.monotonic()

    # -- rank files and the merge -----------------------------------------------------------

    def merge(self, trace: Trace, out_dir: Path) -> Trace:
        """Write this rank's file; on rank 0 return the merged trace, elsewhere ``trace``."""
        if not self.distributed:
            return trace
        if self.workers is not None:
            return self._merge_workers(trace, out_dir)
        self.leave()
        own = RankResult(
            rank=self.rank,
            # paths in a rank file are relative to OUT/ranks
            trace=dataclasses.replace(
                trace,
                snapshot=f"rank-{self.rank}/{trace.snapshot}" if trace.snapshot else None,
                notes=[*trace.notes, *(n for n in self.notes if n not in trace.notes)],
            ),
            ended=self.ended,
            run_id=self.run_id,
        )
        payload = _payload(own, self.world_size)
        from nanhunt.report.files import atomic_write_text

        path = rank_file(out_dir, self.rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, payload)
        except (OSError, NanhuntError) as exc:  # the store may still carry it to rank 0
            own.trace.notes.append(f"rank {self.rank} could not write {path}: {exc}")
            payload = _payload(own, self.world_size)
        # a spawned worker's parent reads the files (one node); the store may be gone with rank 0
        store = None if self.parent_merges else self._get_store()
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(f"trace/{self.rank}", zlib.compress(payload.encode("utf-8")))
        if not self.writes_report:
            return trace
        results = self._collect(own, out_dir, store)
        reason = f"within {self.timeout:g} s ({RANK_TIMEOUT_ENV})"
        if self.terminated_at is not None:
            reason = "before torchrun stopped the workers (it does once one fails or is killed)"
        return merge_traces(results.values(), self.world_size, missing_reason=reason)

    def _merge_workers(self, own: Trace, out_dir: Path) -> Trace:
        """The parent of spawned workers: their rank files merged, with how the parent's own
        script ended (a crash after the workers finished is the run's crash)."""
        assert self.workers is not None
        nprocs, run_id, started = self.workers
        merged = merge_rank_files(out_dir, nprocs, newer_than=started - 1, run_id=run_id)
        if merged is None:
            own.notes.append(
                f"the script started {nprocs} workers (torch.multiprocessing) but none wrote a "
                "report (killed before it could)")
            return own
        parent = own.run
        if parent.status in _ENDED and merged.run.status not in _ENDED:
            merged.run.status, merged.run.error = parent.status, parent.error
        elif parent.status == "stopped" and merged.run.status not in _ENDED:
            merged.run.status = "stopped"
        merged.run.exit_code = parent.exit_code
        merged.run.finished = parent.finished
        merged.run.world_size = nprocs
        merged.notes.insert(0, (
            f"the script started {nprocs} workers itself (torch.multiprocessing); each ran under "
            "its own nanhunt session, and rank r is the worker with index r"))
        if own.steps:
            merged.notes.append(
                f"the parent process ran {len(own.steps)} training steps of its own; they are "
                "not in this report")
        merged.notes.extend(n for n in [*own.notes, *self.notes] if n not in merged.notes)
        return merged

    def exit_code(self, code: int, trace: Trace) -> int:
        """The process's exit code. Rank 0's carries the merged result. Another rank that found a
        problem and stopped with the others exits 0: torchrun stops every worker as soon as one
        exits non-zero, which would cut rank 0's merged report short. A rank that crashed keeps
        its code, so that torchrun releases peers blocked in a collective. Under
        ``nanhunt diagnose --nproc-per-node``, rank 0 too exits 0 after a problem every rank
        reported (the launcher reads the code from the report), which keeps torchrun's failure
        summary from burying nanhunt's."""
        from nanhunt.errors import EXIT_PROBLEM

        if not self.distributed or code != EXIT_PROBLEM or trace.run.status in _ENDED:
            return code
        if self.rank != 0:
            return 0
        if os.environ.get(_LAUNCHER_ENV) and trace.ranks and all(r.answered for r in trace.ranks):
            return 0
        return code

    def _collect(self, own: RankResult, out_dir: Path, store: Any) -> dict[int, RankResult]:
        results = {self.rank: own}
        deadline = time.monotonic() + self.timeout
        while True:
            for r in range(self.world_size):
                if r not in results:
                    res = self._fetch(r, out_dir, store)
                    if res is not None:
                        results[r] = res
            if len(results) == self.world_size:
                return results
            if self.terminated_at is not None:
                writing = any(
                    self._has_left(r, store) for r in range(self.world_size) if r not in results
                )
                grace = _TERM_GRACE_WRITING if writing else _TERM_GRACE
                deadline = min(deadline, self.terminated_at + grace)
            if time.monotonic() >= deadline:
                return results
            time.sleep(_POLL)

    @staticmethod
    def _has_left(r: int, store: Any) -> bool:
        try:
            return store is not None and bool(store.check([f"left/{r}"]))
        except Exception:
            return False

    def _fetch(self, r: int, out_dir: Path, store: Any) -> RankResult | None:
        if store is not None:
            try:
                key = f"trace/{r}"
                if store.check([key]):
                    res = _parse_payload(zlib.decompress(store.get(key)).decode("utf-8"))
                    if res.rank == r:
                        return res
            except Exception:
                pass
        res = read_rank_file(rank_file(out_dir, r))
        if res is not None and res.rank == r and res.run_id == self.run_id:
            return res
        return None


# ----------------------------------------------------------------------------- the launcher
