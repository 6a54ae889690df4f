"""The always-on sentinel: the cheap composition of the capture parts, and a full-tracing replay
of the one step that fails.

Every step it runs only the loss, GradScaler and optimizer observers of full tracing (the loss
row, found_inf and the scale, one fused max-norm over the updated parameters), one fused norm
over the gradients before the optimizer step (:class:`~.keep.GradCheck`), and keeps by
reference what a replay needs (:class:`~.keep.RootWatch`, :class:`~.keep.KeptLoss`). The same
recorder and judge decide that a step failed.

Inside the user's hooks a failing step is only recorded (a :class:`Trip`): the references kept,
and copies of what the optimizer step is about to overwrite (the weights, the optimizer's and
GradScaler's state). The analysis (a replay of the step under full tracing, the check that it
reproduces, the diagnosis and the reports) runs after the user's step has returned: at the
first root module call of the next step, or when the session stops. It is not part of this
package: an *analyst* injected from above does it (``nanhunt.Sentinel`` composes
:class:`nanhunt.replay.step.TripAnalyst`); capture never imports the replay or the pipeline.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanhunt import stats as _stats
from nanhunt.capture._util import _foreach_amax, _version
from nanhunt.capture.autograd import AutogradObserver
from nanhunt.capture.keep import GradCheck, KeptLoss, RootWatch, StepKeep, grad_rows
from nanhunt.capture.modules import ModuleObserver
from nanhunt.capture.optimizer import OptimizerObserver
from nanhunt.capture.session import Session, StopRun
from nanhunt.capture.state import _StepData
from nanhunt.errors import NanhuntError
from nanhunt.trace import Failure, RunInfo, Trace

SPIKE_WINDOW = 50  # finite losses of recent steps a spike is judged against
SPIKE_MIN = 20  # steps of history before a spike can be called


@dataclass
class Trip:
    """A failing step as the sentinel's hook recorded it, for the analysis after the step.

    ``kind``: ``"replay"`` (replay the step to find the origin), ``"optimizer"`` (weights an
    optimizer step wrote are non-finite: that update is the failure; the forward is replayed
    for the op-level zoom only) or ``"traced"`` (full tracing located it: only the report is
    left). ``held``: what the analyst copied inside the hook, before the update overwrote it;
    ``refused``: why it copied nothing (over the replay's memory cap)."""

    data: _StepData
    problem: str | None
    kind: str
    keep: StepKeep | None = None
    scale: float | None = None
    bad: list[tuple[torch.Tensor, str, str]] = field(default_factory=list)
    held: Any = None
    refused: str = ""

    @property
    def step(self) -> int:
        return self.data.index


class Sentinel(Session):
    """Check every step for almost nothing; diagnose the failing step in full by replaying it.

    ``out``: where the reports go when a failure is diagnosed (``None``: keep them in memory,
    read :meth:`trace`). ``stop``: raise :class:`StopRun` at the end of the failing step (the
    ``with`` block swallows it, so the code after the block runs). Other options are
    :class:`Hunt`'s (``keep_steps``, ``allow_inf``, ``collapse_scale``, ``max_steps``,
    ``on_step``). See docs/api.md.
    """

    def __init__(self, model: nn.Module | None = None, optimizer: Any = None, scaler: Any = None,
                 *, out: str | Path | None = "nanhunt-report", target: str | None = None,
                 stop: bool = False, spike: float = 10.0, report: bool = True,
                 analyst: Any = None, **options: Any) -> None:
        options.pop("stop_on_problem", None)
        super().__init__(model, optimizer, scaler, target=target or "auto",
                         stop_on_problem=stop, **options)
        self.out = Path(out) if out is not None else None
        self.stop_run = stop
        self.spike = spike
        self.report = report and self.out is not None
        self.reported: Trace | None = None  # what was written to ``out``
        # replays and reports a trip after the user's step (None: the trip is only recorded)
        self.analyst = analyst

    # -- composition ------------------------------------------------------------------------

    def _compose(self) -> None:
        self.roots = RootWatch(self)
        self.grads = GradCheck(self)
        self.loss = KeptLoss(self)
        # no per-step pass over the updated parameters: a CPU step spends most of its time in
        # such passes (the optimizer's), so they are checked once, when a step fails
        self.optimizer_obs = OptimizerObserver(self, check_params=False, measure_grads=False)
        self._last_update = -1  # the last step whose optimizer step ran
        self._versions: dict[int, tuple[int, int]] = {}  # id(weight) -> (counter, step) after it
        self.keep = StepKeep(0)
        self._in_root: nn.Module | None = None
        self._optimizers: dict[int, Any] = {}
        self._tracing = False  # switched to full tracing (a replay did not reproduce)
        self._diagnosed = False
        self._handled: set[int] = set()
        self._streak: tuple[StepKeep, float | None] | None = None  # first skip of a streak
        self._losses: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self._pending: list[Trip] = []  # recorded in a hook, analysed between steps
        self._tripped = False  # a trip waits for its analysis: no second one meanwhile
        self._analysing = False
        self.ending = False
        self.replay: Any = None  # the analyst's replay of the failing step
        self.notes: list[str] = []
        self.kept_bytes = 0  # what the kept references held at the failing step

    def _observers(self) -> list[Any]:
        return [self.roots, self.loss, self.scaler_obs, self.grads, self.signals,
                self.optimizer_obs]

    def _step_begun(self) -> None:
        if self._optimizer_ran_step == self._step - 1:
            self._last_update = self._step - 1
        self._full = self._tracing
        self._in_root = None
        self.keep = StepKeep(self._step)
        self.roots.step_begun()

    def start(self) -> Sentinel:
        super().start()
        return self

    def __enter__(self) -> Sentinel:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> bool:
        super().__exit__(exc_type, exc, tb)
        return isinstance(exc, StopRun) and self._diagnosed  # our own stop ends the block

    # -- the analysis, between steps ----------------------------------------------------------

    def _step_boundary(self, module: nn.Module, args: tuple) -> None:
        """The first root call of a step: the step before it has returned to the user's loop,
        so a trip recorded in it is analysed now (under the replay contract: nothing the user
        can observe changes). With ``stop``, the script stops here once it is diagnosed."""
        if not self._pending or self._analysing:
            return
        tripped = self._pending[0].step
        self._analyse_pending()
        if self._tracing and not self._full:  # traced in full from this very call
            self._full = self.cur.traced = True
            self.judge.traced_steps.add(self._step)
            self.modules._on_pre(module, args)  # (its global pre-hook has run already)
        if self._diagnosed and self.stop_run:
            raise StopRun(f"nanhunt stopped the script after step {tripped}, where the first "
                          "non-finite value appeared")

    def _session_ending(self) -> None:
        self.ending = True  # no step follows: a replay that does not reproduce says so
        self._analyse_pending()

    def _analyse_pending(self) -> None:
        self._analysing = True
        try:
            while self._pending:
                trip = self._pending.pop(0)
                errors = len(self.internal_errors)
                self._guard(self._analyse, trip)
                if len(self.internal_errors) > errors and not self._diagnosed:
                    # a bug of ours in the analysis: still the report of what was recorded,
                    # with the error in its notes
                    self._guard(self.finish)
        finally:
            self._analysing = False
            self._tripped = False

    def _analyse(self, trip: Trip) -> None:
        if trip.kind == "traced":
            self.finish()
        elif self.analyst is None:
            self.notes.append(f"sentinel: step {trip.step} failed ({_what(trip.problem)}); it "
                              "was not replayed (this sentinel has no analyst)")
            self.finish()
        else:
            self.analyst.analyse(self, trip)

    def optimizer_for_replay(self) -> Any:
        if self._optimizer_ref is not None and self._optimizer_ref() is not None:
            return self._optimizer_ref()
        alive = [r() for r in self._optimizers.values() if r() is not None]
        return alive[0] if len(alive) == 1 else None

    # -- per step ---------------------------------------------------------------------------

    def _flush(self, norm: bool = True) -> None:
        keep, cur = self.keep, self.cur
        if keep.closure and not keep.grad_checked and not self._in_closure and norm \
                and cur.opt_params is not None and not cur.step_scaler and self._active:
            # an optimizer closure (LBFGS, Lightning) ran the backward: the check goes here,
            # after its first call, still before the update
            self.grads.check(cur.opt_params)
        super()._flush(norm)
        if self._active:
            self._after_flush()

    def _end_step(self) -> None:
        rows = self.recorder.pending_rows
        if rows and rows[0].device.type == "cpu" and self._active:
            # the updated parameters' rows: judged before this step's inputs are let go (on a
            # CPU reading them costs nothing)
            self._flush()
        super()._end_step()

    def _on_failure(self, d: _StepData, origin_step: _StepData) -> None:
        if self._tracing:  # traced like Hunt: keep the culprit now
            self.snapshots.take(d, origin_step)

    def _after_flush(self) -> None:
        d = self.recorder.find_step(self._step)
        rec = self.recorder.step_records.get(self._step)
        if d is None or rec is None:
            return
        if d.optimizer_ran:  # (a skipped step's update is seen in the same transfer)
            self._streak = None
        elif d.scale_after is not None and rec.skipped and self._streak is None:
            self._streak = (self.keep, d.scale)  # the first skip of a streak: kept for a collapse
        if d.loss is not None and math.isfinite(d.loss) and d.index not in self._handled:
            self._check_spike(d)
        if d.problem is None and d.grad_sumsq is not None and not math.isfinite(d.grad_sumsq) \
                and d.index == self.keep.step and self.keep.grad_checked:
            self._check_grads(d, rec)
        for index in sorted(self.judge.problem_steps):
            if index in self._handled or self._diagnosed or self._tripped:
                continue
            self._handled.add(index)
            failed = self.recorder.find_step(index)
            if failed is not None and failed.problem is not None:
                self._guard(self._trip, failed)

    def _check_grads(self, d: _StepData, rec: Any) -> None:
        """The gradient norm is non-finite: which gradients are (exactly, once)."""
        opt = self.optimizer_for_replay()
        params = [p for g in opt.param_groups for p in g["params"]] if opt else []
        bad = grad_rows(self, params)
        if not bad:  # the float32 norm of finite, very large gradients overflowed
            self.judge.note_fact(("grad-norm", "", str(d.index)),
                                 f"step {d.index}: the gradient norm overflowed float32; "
                                 "every gradient was finite")
            return
        d.problem = "grad"
        rec.nonfinite = True
        if d.index not in self.judge.problem_steps:
            self.judge.problem_steps.append(d.index)
        p, name, owner = bad[0]
        if self.judge.first_failure is None:  # until the replay names the origin
            stats = _stats.decode(_stats.summarize(p.grad, self.format).cpu().numpy(),
                                  str(p.grad.dtype).removeprefix("torch."),
                                  tuple(p.grad.shape), self.format)
            self.judge.first_failure = Failure(step=d.index, phase="backward", module=owner,
                                               tensor=f"{name}.grad", stats=stats)

    def _check_spike(self, d: _StepData) -> None:
        if len(self._losses) >= SPIKE_MIN:
            med = statistics.median(self._losses)
            if med > 0 and d.loss > self.spike * med:
                self.judge.note_fact(("spike", "", str(d.index)),
                                     f"step {d.index}: the loss spiked to {d.loss:.4g} "
                                     f"({d.loss / med:.3g}x the median of the last "
                                     f"{len(self._losses)} steps)")
        self._losses.append(d.loss)

    # -- a failing step ---------------------------------------------------------------------

    def _trip(self, d: _StepData) -> None:
        """Inside the user's hook: record the failing step and copy what its optimizer step is
        about to overwrite; nothing is replayed here (see :meth:`_step_boundary`)."""
        problem = d.problem
        self.kept_bytes = self.keep.nbytes()
        if self._tracing:
            if self.judge.first_failure is not None:
                self.notes.append(f"sentinel: step {d.index} was traced in full (the earlier "
                                  "replay had not reproduced its failure)")
                self._record(Trip(d, problem, "traced"))
            return
        bad = self._optimizer_wrote(self._nonfinite_params())
        if bad:  # the weights were already non-finite: an earlier optimizer step made them so
            self._optimizer_made(d, bad)
            return
        keep, scale = (self._streak if problem == "collapse" and self._streak else
                       (self.keep, d.scale))
        if keep.step != d.index and problem != "collapse":
            keep = StepKeep(d.index)  # its inputs are gone: the replay says so
        self._record(Trip(d, problem, "replay", keep=keep, scale=scale))

    def _record(self, trip: Trip) -> None:
        self._tripped = True
        if self.analyst is not None and trip.keep is not None and trip.keep.calls:
            was, self._active = self._active, False  # (copying builds objects we must not see)
            try:
                trip.held = self.analyst.hold(self, trip)
            except NanhuntError as exc:  # over the cap: said in the report, nothing copied
                trip.refused = str(exc)
            finally:
                self._active = was
        self._pending.append(trip)

    def undo_problem(self, d: _StepData, keep_mark: bool = False) -> None:
        """The step's failure is not the one reported (the replay did not reproduce it)."""
        self.judge.first_failure = None
        self.judge.problem = None
        self.judge.dismissed.add(d.index)  # (its later rows must not locate it again)
        self._stop_pending = False
        if not keep_mark:
            d.problem = None
            if d.index in self.judge.problem_steps:
                self.judge.problem_steps.remove(d.index)
            rec = self.recorder.step_records.get(d.index)
            if rec is not None:
                rec.nonfinite = False

    @torch.no_grad()
    def _nonfinite_params(self) -> list[tuple[torch.Tensor, str, str]]:
        """The optimizer's non-finite parameters, in its order (one pass, at a failure only)."""
        opt = self.optimizer_for_replay()
        params = [p for g in opt.param_groups for p in g["params"]] if opt is not None else \
            list(self.naming.param_names)
        params = [p for p in params if _stats.summarizable(p) and not p.is_sparse]
        bad = []
        for device in {p.device for p in params}:
            ps = [p for p in params if p.device == device]
            amax = _foreach_amax(ps)
            bad_idx = set(torch.nonzero(~torch.isfinite(amax)).flatten().tolist())
            bad += [(p, *self.naming.param_names.get(p, ("<param>", "")))
                    for i, p in enumerate(ps) if i in bad_idx]
        order = {id(p): i for i, p in enumerate(params)}
        return sorted(bad, key=lambda b: order[id(b[0])])

    def _optimizer_wrote(self, bad: list[tuple[torch.Tensor, str, str]]) -> list[Any]:
        """Those of ``bad`` nothing has edited in place since an optimizer step wrote them
        (a weight changed after it, by a load or the user's code, is the forward's input)."""
        return [b for b in bad if self._versions.get(id(b[0]), (None, -1))[0] == _version(b[0])]

    def _optimizer_made(self, d: _StepData, bad: list[tuple[torch.Tensor, str, str]]) -> None:
        """Weights went non-finite in an optimizer step whose gradients were finite (checked
        then): the failure is that update, named as full tracing names it; the analysis
        replays the forward of this step on those weights for the culprit's op-level zoom."""
        p, name, owner = bad[0]
        row = _stats.summarize(p, self.format).cpu().numpy()
        stats = _stats.decode(row, str(p.dtype).removeprefix("torch."), tuple(p.shape),
                              self.format)
        step = self._versions.get(id(p), (0, self._last_update))[1]
        failure = Failure(step=step, phase="optimizer", module=owner, tensor=name, stats=stats)
        self.undo_problem(d, keep_mark=True)
        self.judge.first_failure = failure
        self.judge.problem = "param"
        rec = self.recorder.step_records.get(step)
        if rec is not None:
            rec.nonfinite = True
        if step not in self.judge.problem_steps:
            self.judge.problem_steps.append(step)
        self._record(Trip(d, d.problem, "optimizer", keep=self.keep if self.keep.calls else None,
                          scale=d.scale, bad=bad))

    def stop(self) -> None:
        if self._stack is not None and self._active and not self._diagnosed and \
                not self._tripped and self._last_update >= 0:
            with contextlib.suppress(Exception):  # the last update, which no step followed
                bad = self._optimizer_wrote(self._nonfinite_params())
                if bad:
                    d = self.recorder.data_for(self._versions[id(bad[0][0])][1])
                    self._optimizer_made(d, bad)
        super().stop()

    def compiled_only(self, keep: StepKeep, outputs: list, compiled: list[str]) -> bool:
        """A compiled root's output was non-finite and its eager replay on the same inputs was
        finite: the NaN comes from the compiled code."""
        for c, outs in zip(keep.calls, outputs):
            label = self.naming.names.get(c.module) or type(c.module).__name__
            if label not in compiled:
                continue
            for (path, a), (_q, b) in zip(c.outputs, outs):
                a, b = a.detach(), b.detach()
                if not a.is_floating_point() or bool(torch.isfinite(a).all()) or \
                        not bool(torch.isfinite(b).all()):
                    continue
                both = torch.isfinite(a)
                diff = (f"largest |compiled - eager| over the values finite in both: "
                        f"{float((a[both].float() - b[both].float()).abs().max()):.3g}"
                        if both.any() else "no value was finite in the compiled output")
                stats = _stats.decode(_stats.summarize(a, self.format).cpu().numpy(),
                                      str(a.dtype).removeprefix("torch."), tuple(a.shape),
                                      self.format)
                bad = stats.nan + stats.posinf + stats.neginf
                detail = (f"non-finite only in the compiled code: the compiled {label} gave "
                          f"{bad} non-finite values in {path}, an eager replay of the same call "
                          f"on the same inputs gave none ({diff})")
                self.judge.first_failure = Failure(step=keep.step, phase="forward",
                                                   module=label, tensor=path, stats=stats,
                                                   detail=detail)
                self.judge.problem = "output"
                self.notes.append(f"sentinel: step {keep.step}: {detail}")
                return True
        return False

    def switch_to_tracing(self) -> None:
        """Full tracing from now on: the module and autograd observers join."""
        self._tracing = True
        self.modules = ModuleObserver(self)
        self.autograd = AutogradObserver(self)
        assert self._stack is not None
        self.modules.install(self._stack)
        self.autograd.install(self._stack)
        self.optimizer_obs.check_params = self.optimizer_obs.measure_grads = True
        for p in list(self.naming.param_names.keys()):
            self.autograd.hook_param(p)
        self.naming.on_param = self.autograd.hook_param

    def finish(self) -> None:
        """The failing step is diagnosed: the analyst writes the reports (with ``out``)."""
        self._diagnosed = True
        if self.report and self.analyst is not None:
            # the analysis replays modules: our hooks stand aside (and stay off after an
            # internal error)
            was, self._active = self._active, False
            try:
                self.analyst.report(self)
            finally:
                self._active = was

    # -- the result -------------------------------------------------------------------------

    def trace(self, run: RunInfo | None = None) -> Trace:
        t = super().trace(run)
        t.run.mode = "sentinel"
        h = getattr(self.replay, "hunt", None)
        if h is not None and self.first_failure is not None and h.first_failure is not None \
                and self.judge.first_failure is h.first_failure:
            mine = {layer.module: layer for layer in t.layers}
            layers = h.layers
            for layer in layers:
                own = mine.pop(layer.module, None)
                if own is not None:
                    layer.param_amax_by_step = {**own.param_amax_by_step,
                                                **layer.param_amax_by_step}
            t.layers = layers + list(mine.values())
            t.grad_hist = h.grad_histograms()
            for rec in h.steps:
                mine_rec = next((s for s in t.steps if s.index == rec.index), None)
                if mine_rec is not None:
                    mine_rec.records = rec.records
                    mine_rec.nonfinite = mine_rec.nonfinite or rec.nonfinite
        if self.kept_bytes:
            self.notes_once(f"sentinel: the references kept for a replay held "
                            f"{self.kept_bytes / 2**20:.3g} MiB at the failing step")
        t.notes = list(self.notes) + t.notes
        return t

    def notes_once(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def _what(problem: str | None) -> str:
    return {"loss": "a non-finite loss", "grad": "non-finite gradients",
            "collapse": "a collapsing loss scale", "param": "non-finite parameters",
            "output": "a non-finite model output"}.get(problem or "", "a failure")


def _counts(t: torch.Tensor) -> tuple[int, int, int]:
    t = t.detach()
    return int(t.isnan().sum()), int(t.isposinf().sum()), int(t.isneginf().sum())


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN equal to NaN."""
    if a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    return bool(((a == b) | (a.isnan() & b.isnan())).all())
