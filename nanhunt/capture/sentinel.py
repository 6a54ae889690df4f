"""The always-on sentinel: the cheap composition of the capture parts, and a full-tracing replay
of the one step that fails.

Every step it runs only the loss, GradScaler and optimizer observers of full tracing (the loss
row, found_inf and the scale, one fused max-norm over the updated parameters), one fused norm
over the gradients before the optimizer step (:class:`~.keep.GradCheck`), and keeps by
reference what a replay needs (:class:`~.keep.RootWatch`, :class:`~.keep.KeptLoss`). The same
recorder and judge decide that a step failed; the step is then replayed under a full-tracing
:class:`~.session.Hunt` on copies (:mod:`.replay`), checked to reproduce, and analysed.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
from collections import deque
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
from nanhunt.replay.step import Replay, replay_step
from nanhunt.trace import Failure, RunInfo, Trace

SPIKE_WINDOW = 50  # finite losses of recent steps a spike is judged against
SPIKE_MIN = 20  # steps of history before a spike can be called


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
                 **options: Any) -> None:
        options.pop("stop_on_problem", None)
        super().__init__(model, optimizer, scaler, target=target or "auto",
                         stop_on_problem=stop, **options)
        self.out = Path(out) if out is not None else None
        self.stop_run = stop
        self.spike = spike
        self.report = report and self.out is not None
        self.reported: Trace | None = None  # what was written to ``out``

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
        self.replay: Replay | None = None
        self.notes: list[str] = []
        self.kept_bytes = 0  # what the kept references held at the failing step

    def _observers(self) -> list[Any]:
        return [self.roots, self.loss, self.scaler_obs, self.grads, self.optimizer_obs]

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
            if index in self._handled or self._diagnosed:
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
        problem = d.problem
        self.kept_bytes = self.keep.nbytes()
        if self._tracing:
            if self.judge.first_failure is not None:
                self.notes.append(f"sentinel: step {d.index} was traced in full (the earlier "
                                  "replay had not reproduced its failure)")
                self._finish()
            return
        bad = self._optimizer_wrote(self._nonfinite_params())
        if bad:  # the weights were already non-finite: an earlier optimizer step made them so
            self._optimizer_made(d, bad)
            return
        keep, scale = (self._streak if problem == "collapse" and self._streak else
                       (self.keep, d.scale))
        if keep.step != d.index and problem != "collapse":
            keep = StepKeep(d.index)  # its inputs are gone: the replay says so
        r = replay_step(self, keep, scale=scale, collapse=problem == "collapse")
        self.replay = r
        ok, why = self._reproduced(problem, d, keep, r)
        if ok:
            self._adopt(r)
            self.notes.append(
                f"sentinel: step {keep.step} ({_what(problem)}) was replayed with full tracing "
                "from the inputs kept by reference and the parameters as they were before the "
                f"optimizer step; the replay reproduced it ({why})")
            if r.compiled:
                self.notes.append(f"the compiled module {', '.join(r.compiled)} was replayed "
                                  "eagerly to name the layer and op inside it")
            self._finish()
            return
        if r.compiled and self._compiled_only(keep, r, d):
            self._finish()
            return
        self.notes.append(
            f"sentinel: step {keep.step} failed ({_what(problem)}) but its replay did not "
            f"reproduce it ({why}); full tracing from step {self._step + 1} on")
        self._undo_problem(d, keep_mark=True)
        self._switch_to_tracing()

    def _undo_problem(self, d: _StepData, keep_mark: bool = False) -> None:
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

    def _reproduced(self, problem: str | None, d: _StepData, keep: StepKeep,
                    r: Replay) -> tuple[bool, str]:
        if not r.ran:
            return False, f"the replay raised {r.error}"
        if r.stale:
            return False, f"kept inputs were changed in place after the call ({r.stale[0]})"
        h = r.hunt
        if h is None or h.first_failure is None:
            return False, "every replayed value was finite"
        if problem == "loss":
            for c, outs in zip(keep.calls, r.outputs):
                for (_p, a), (_q, b) in zip(c.outputs, outs):
                    if a.shape != b.shape or not _same_values(a.detach(), b.detach()):
                        return False, f"the replayed {_p} differs from the step's own"
            if r.loss is not None and math.isfinite(r.loss):
                return False, "the replayed loss was finite"
            return True, "the same root outputs and a non-finite loss"
        if problem == "grad":
            opt = self.optimizer_for_replay()
            params = [p for g in opt.param_groups for p in g["params"]] if opt else []
            checked = 0
            for p in params:
                g, rg = p.grad, r.grads.get(id(p))
                if g is None or rg is None:
                    continue
                if _counts(g) != _counts(rg):
                    return False, "the replayed gradients' non-finite values differ"
                checked += 1
            return True, f"the same NaN/inf counts in all {checked} parameter gradients"
        if problem == "collapse":
            if r.skipped is False:
                return False, "the replayed step was not skipped by the GradScaler copy"
            return True, "GradScaler skipped the replayed step too"
        return True, "the replay failed at the same step"

    def _adopt(self, r: Replay) -> None:
        h = r.hunt
        assert h is not None
        self.judge.first_failure = h.first_failure
        self.judge.problem = h.problem
        self.snapshot = h.snapshot
        self.failure_extra.update(h.failure_extra)
        for fact in h.facts:
            if fact not in self.judge.facts:
                self.judge.facts.append(fact)

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
        then): the failure is that update, named as full tracing names it; the forward of this
        step is replayed on those weights for the culprit's op-level snapshot."""
        p, name, owner = bad[0]
        row = _stats.summarize(p, self.format).cpu().numpy()
        stats = _stats.decode(row, str(p.dtype).removeprefix("torch."), tuple(p.shape),
                              self.format)
        step = self._versions.get(id(p), (0, self._last_update))[1]
        failure = Failure(step=step, phase="optimizer", module=owner, tensor=name, stats=stats)
        self._undo_problem(d, keep_mark=True)
        self.judge.first_failure = failure
        self.judge.problem = "param"
        rec = self.recorder.step_records.get(step)
        if rec is not None:
            rec.nonfinite = True
        if step not in self.judge.problem_steps:
            self.judge.problem_steps.append(step)
        if self.keep.calls:
            preset = Failure(step=self.keep.step, phase="optimizer", module=owner, tensor=name,
                             stats=stats)
            r = replay_step(self, self.keep, scale=d.scale, collapse=False, preset=preset)
            self.replay = r
            if r.hunt is not None:
                self.snapshot = r.hunt.snapshot
        others = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        self.notes.append(
            f"sentinel: the optimizer step at step {step} made {name}{others} non-finite from "
            f"finite gradients; found when step {d.index} failed ({_what(d.problem)}), by one "
            "pass over the weights; the update itself was not replayed (it overwrote what it "
            "read); the forward of step "
            f"{self.keep.step} was replayed on the updated weights for the op-level zoom")
        self._finish()

    def stop(self) -> None:
        if self._stack is not None and self._active and not self._diagnosed and \
                self._last_update >= 0:
            with contextlib.suppress(Exception):  # the last update, which no step followed
                bad = self._optimizer_wrote(self._nonfinite_params())
                if bad:
                    d = self.recorder.data_for(self._versions[id(bad[0][0])][1])
                    self._optimizer_made(d, bad)
        super().stop()

    def _compiled_only(self, keep: StepKeep, r: Replay, d: _StepData) -> bool:
        """A compiled root's output was non-finite and its eager replay on the same inputs was
        finite: the NaN comes from the compiled code."""
        for c, outs in zip(keep.calls, r.outputs):
            label = self.naming.names.get(c.module) or type(c.module).__name__
            if label not in r.compiled:
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

    def _switch_to_tracing(self) -> None:
        """Full tracing from the next step: the module and autograd observers join."""
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

    def _finish(self) -> None:
        self._diagnosed = True
        if self.report:
            self._write_report()
        if self.stop_run:
            self._stop_pending = True

    def _write_report(self) -> None:
        from nanhunt.pipeline import analyse_and_report

        assert self.out is not None
        self.out.mkdir(parents=True, exist_ok=True)
        run = RunInfo(command=list(sys.argv), script=sys.argv[0] if sys.argv else "",
                      torch=torch.__version__, status="running")
        self._active = False  # the analysis replays modules: our hooks stand aside
        try:
            self.reported = analyse_and_report(self, run, self.out, quiet=True)
        finally:
            self._active = True
        f = self.first_failure
        print(f"nanhunt sentinel: first non-finite value at {f.where() if f else '?'}; "
              f"report in {self.out}/", file=sys.stderr)

    # -- the result -------------------------------------------------------------------------

    def trace(self, run: RunInfo | None = None) -> Trace:
        t = super().trace(run)
        t.run.mode = "sentinel"
        h = self.replay.hunt if self.replay is not None else None
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


def sentinel(model: nn.Module | None = None, optimizer: Any = None, scaler: Any = None, *,
             out: str | Path | None = "nanhunt-report", target: str | None = None,
             stop: bool = False, **options: Any) -> Sentinel:
    """The always-on sentinel: a context manager, or call ``start()``/``stop()``."""
    return Sentinel(model, optimizer, scaler, out=out, target=target, stop=stop, **options)
