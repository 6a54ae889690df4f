"""The judge: whether a decoded step has a problem, and where the first failure is."""

from __future__ import annotations

import math
from typing import Any

from nanhunt.capture.locate import Rec, find_origin
from nanhunt.capture.state import _Meta, _StepData
from nanhunt.trace import Failure, StepRecord, TensorStats


class Judge:
    """Reads each decoded step once (the recorder calls :meth:`judge`): a non-finite loss,
    parameter or applied gradient, a non-finite root output, or a collapsing loss scale is a
    problem; the first one is located (:func:`nanhunt.capture.locate.find_origin`) and handed to
    ``on_failure(step_data, origin_step_data)``, which keeps the evidence and asks to stop.
    Non-finite values a later module absorbed, and GradScaler's skips, become facts."""

    def __init__(self, collapse_scale: float = 1.0, on_failure: Any = None) -> None:
        self.collapse_scale = collapse_scale
        self.on_failure = on_failure
        self.recorder: Any = None  # set by the session (the recorder holds this judge too)
        self.first_failure: Failure | None = None
        self.problem: str | None = None
        self.facts: list[str] = []
        self.fact_keys: set[tuple[str, str, str]] = set()
        self.skip_streak = 0
        self.last_counted_skip = -1
        self.problem_steps: list[int] = []
        self.failure_order = self.origin_order = 0
        self.dismissed: set[int] = set()  # steps that may no longer become the first failure
        # sampled mode: steps that ran with full tracing; a failure on another step is not
        # located there (only its loss and gradient norm were seen) but traced again at its next
        # occurrence when that step left the weights unchanged
        self.traced_steps: set[int] = set()
        self.untraced_failure: Failure | None = None
        # whether the step being judged trained with no torch optimizer (the script updates its
        # weights itself, unseen): set by the session
        self.updates_itself: Any = lambda: False
        # replays a skipped step's culprit without the loss scale (Hunt's snapshots); see
        # :meth:`scale_free`
        self.probe: Any = None
        self.probes_left = 16
        self.probe_detail: str | None = None
        self.origin_call: int | None = None  # the culprit's call in its step, when known
        # phase communication: gradient name -> (how it was reduced, the reduction's dtype)
        self.reductions: dict[str, tuple[str, str | None]] = {}

    def before_failure(self, meta: _Meta) -> bool:
        """Per-layer ranges stop at the origin: what follows it is contaminated."""
        f = self.first_failure
        if f is None or meta.step < f.step:
            return True
        return meta.step == f.step and meta.order <= self.failure_order

    def judge(self, d: _StepData, rec: StepRecord) -> None:
        """Decide whether this step has a problem, and find the origin the first time."""
        scaled = d.scale is not None
        bad = {m.role for m, r in zip(d.metas, d.rows) if r[1] + r[2] + r[3] > 0}
        problem = None
        if (d.loss is not None and not math.isfinite(d.loss)) or "loss" in bad:
            problem = "loss"
        elif "param" in bad:
            problem = "param"
        elif bad & {"param_grad", "reduced_grad"} and (not scaled or d.optimizer_ran) and \
                not (scaled and d.found_inf):
            problem = "grad"
        elif self.root_output_bad(d):
            problem = "output"
        if rec.skipped and d.scale_after is not None:
            if d.index > self.last_counted_skip:
                self.last_counted_skip = d.index
                self.skip_streak += 1
                self.note_fact(("scaler", "", str(d.scale)),
                               f"step {d.index}: GradScaler found inf/NaN in the scaled gradients "
                               f"at scale {d.scale:g} and skipped the step "
                               f"(scale -> {d.scale_after:g})")
            if d.scale_after < self.collapse_scale and problem is None:
                problem = "collapse"
            elif problem is None and self.scale_free(d):
                problem = "scale_free"
        elif d.scale_after is not None and not rec.skipped:
            self.skip_streak = 0
        if problem is None:
            if rec.skipped:
                rec.nonfinite = False  # GradScaler's overflow on purpose: a fact, not a mark
            elif rec.nonfinite:
                # only absorbed values (masks): not worth a mark in the timeline
                recs, parents = self.recs(d)
                loss_ok = None if d.loss is None else math.isfinite(d.loss)
                rec.nonfinite = find_origin(recs, parents, loss_ok) is not None
            self.note_absorbed(d)
            return
        d.problem = problem
        rec.nonfinite = True
        if d.index not in self.problem_steps:
            self.problem_steps.append(d.index)
        if self.first_failure is not None or d.index in self.dismissed:
            return
        if d.index not in self.traced_steps and self.untraced_failure is None:
            failure = self.locate(d, problem)  # what the cheap check saw: not an origin
            if failure is not None:
                failure.detail = (f"step {d.index} was not traced (--sample-every): only its "
                                  "loss and gradient norm were checked")
                self.untraced_failure = failure
            if rec.skipped or not (d.optimizer_ran or self.updates_itself()):
                return  # the weights did not change: trace the next occurrence, do not stop
        self.problem = problem
        origin_step = d
        if problem == "collapse":
            first = d.index - self.skip_streak + 1
            origin_step = self.recorder.find_step(first) or d
        failure = self.locate(origin_step, problem)
        if failure is None and origin_step is not d:
            failure = self.locate(d, problem)
        if failure is None:
            return
        self.first_failure = failure
        self.failure_order = self.origin_order
        if self.on_failure is not None:
            self.on_failure(d, origin_step)

    def scale_free(self, d: _StepData) -> bool:
        """A skipped step whose non-finite gradient does not come from the loss scale: the
        module whose backward made it, replayed with its gradients unscaled, still makes it.
        GradScaler's skips are then not calibration but the symptom of a backward op (sqrt
        or a norm at 0) or of gradients too large for the format, found at the first skip
        instead of after the scale has collapsed."""
        if self.probe is None or self.probes_left <= 0 or self.first_failure is not None \
                or d.index in self.dismissed or d.index not in self.traced_steps:
            return False
        recs, parents = self.recs(d)
        origin = find_origin(recs, parents, None if d.loss is None else math.isfinite(d.loss))
        if origin is None or origin.phase != "backward":
            return False
        m = d.metas[origin.index]
        if not m.module:
            return False
        self.probes_left -= 1
        # (a parameter's gradient row names its module, not the call: the probe finds it)
        self.probe_detail = self.probe(d, m.call, m.module)
        return self.probe_detail is not None

    def root_output_bad(self, d: _StepData) -> bool:
        if d.loss is not None or any(m.role in ("loss", "param_grad") for m in d.metas):
            return False  # judged by the loss and gradients instead
        recs, parents = self.recs(d)
        origin = find_origin([r for r in recs if r.phase in ("data", "forward")], parents, None)
        if origin is None:
            return False
        roots = {c for c, p in parents.items() if p is None}
        return any(m.role == "output" and r[1] + r[2] + r[3] > 0
                   and ({m.producer, *m.also_producers} & roots)
                   for m, r in zip(d.metas, d.rows))

    def recs(self, d: _StepData) -> tuple[list[Rec], dict[int, int | None]]:
        recs = []
        parents: dict[int, int | None] = {}
        # a recomputed output (activation checkpointing) is judged only where the forward's own
        # output was finite: the forward's values were judged there once already
        judged = {(m.module, m.tensor) for m, r in zip(d.metas, d.rows)
                  if m.role == "output" and r[1] + r[2] + r[3] > 0}
        for i, (m, r) in enumerate(zip(d.metas, d.rows)):
            nonfinite = r[1] + r[2] + r[3] > 0
            allowed = m.allowed or (m.role == "recomputed" and (
                m.module, m.tensor.removesuffix(" (recomputed)")) in judged)
            recs.append(Rec(
                index=i, order=m.order, phase=m.phase, role=m.role, nonfinite=nonfinite,
                one_sided_neginf=bool(r[3] > 0 and r[1] == 0 and r[2] == 0),
                allowed=allowed, producer=m.producer, parent=m.parent,
                consumers=list(m.consumers), also_producers=list(m.also_producers),
            ))
            if m.producer is not None:
                parents.setdefault(m.producer, m.parent)
            for c in m.consumers:
                parents.setdefault(c, None)
        parents.update(d.parents)
        return recs, parents

    def locate(self, d: _StepData, problem: str) -> Failure | None:
        recs, parents = self.recs(d)
        loss_finite = None if d.loss is None else math.isfinite(d.loss)
        origin = find_origin(recs, parents, loss_finite)
        if origin is None:
            if problem == "loss" and d.loss is not None:
                return Failure(step=d.index, phase="forward", module="", tensor="loss",
                               stats=TensorStats(dtype="float32", shape=[], numel=1, nan=1),
                               detail="the loss was non-finite")
            return None
        m, r = d.metas[origin.index], d.rows[origin.index]
        self.origin_order = m.order
        self.origin_call = m.call if m.call is not None else m.producer
        phase = m.phase
        if problem == "collapse":
            phase = "loss_scaling" if m.phase == "backward" else m.phase
        detail = (self.probe_detail or "") if problem == "scale_free" else ""
        failure = Failure(step=d.index, phase=phase, module=m.module, tensor=m.tensor,
                          stats=self.recorder.stats(m, r), detail=detail)
        if m.role == "recomputed":
            failure.detail = (
                f"made by the forward that activation checkpointing recomputed in backward; "
                f"{m.module}'s forward at this step was finite: the module does not give the "
                "same values twice (state changed between forward and backward, or a "
                "non-deterministic op)")
        if m.phase == "communication":
            failure.reduction, failure.reduce_dtype = self.reductions.get(m.tensor, ("", None))
            # this rank's own gradient of the same parameter, before the reduction (DDP)
            local = next(((lm, lr) for lm, lr in zip(d.metas, d.rows)
                          if lm.role == "param_grad" and lm.phase == "backward"
                          and lm.tensor == m.tensor), None)
            if local is not None:
                failure.local_grad = self.recorder.stats(*local)
        return failure

    def note_absorbed(self, d: _StepData) -> None:
        for m, r in zip(d.metas, d.rows):
            n = int(r[1] + r[2] + r[3])
            if n and m.phase in ("data", "forward"):
                key = (m.module, m.tensor, m.role)
                kinds = ", ".join(f"{int(c)} {k}" for c, k in ((r[1], "NaN"), (r[2], "+inf"),
                                                                 (r[3], "-inf")) if c)
                self.note_fact(key, f"step {d.index}: {m.module or '<top level>'} {m.tensor} "
                                    f"held {kinds}; later values stayed finite (absorbed)")

    def note_fact(self, key: tuple, text: str) -> None:
        if key in self.fact_keys or len(self.facts) >= 50:
            return
        self.fact_keys.add(key)
        self.facts.append(text)
