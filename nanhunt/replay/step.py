"""Replay one kept training step with full tracing, on copies: the root modules' calls on their
kept inputs (eagerly, for compiled ones), backward from the kept output gradients, and the
optimizer step on a copy of the optimizer (and of the GradScaler).

:class:`TripAnalyst` is the sentinel's analysis: inside the user's hook it only copies what the
step's optimizer update is about to overwrite (:meth:`TripAnalyst.hold`); after the user's step
has returned it replays the step under the replay contract (:mod:`nanhunt.contract`), checks
that the replay reproduces the failure, and adopts its diagnosis or switches the sentinel to full
tracing (:meth:`TripAnalyst.analyse`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nanhunt.capture import session as _session
from nanhunt.capture._util import _call_leaves, _leaves, _version, map_tensors
from nanhunt.capture.keep import StepKeep
from nanhunt.capture.session import Hunt
from nanhunt.contract import Copies, CopyRefused, isolated, sharded_how
from nanhunt.trace import SPLIT_ACROSS_RANKS

__all__ = ["Held", "Replay", "TripAnalyst", "replay_step"]


@dataclass
class Replay:
    """What the replay of a step found."""

    hunt: Hunt | None = None
    ran: bool = False
    error: str | None = None
    stale: list[str] = field(default_factory=list)  # kept inputs changed in place since
    outputs: list[list[tuple[str, torch.Tensor]]] = field(default_factory=list)  # per call
    grads: dict[int, torch.Tensor | None] = field(default_factory=dict)  # id(user param) ->
    loss: float | None = None
    skipped: bool | None = None  # the GradScaler copy skipped the optimizer step
    optimizer: str = ""  # why the optimizer step was not replayed, if it was not
    compiled: list[str] = field(default_factory=list)  # compiled roots replayed eagerly


@dataclass
class Held:
    """What a replay of a step needs that the step's own optimizer update overwrites, copied
    inside the hook that saw the failure (the weights and optimizer state before the update,
    the GradScaler's scale), and the kept inputs, cloned (the next batch may reuse their
    memory). ``copies`` declares every byte of it."""

    copies: Copies
    roots: dict[int, nn.Module] = field(default_factory=dict)  # id(user root) -> its copy
    labels: dict[int, str] = field(default_factory=dict)
    compiled: list[str] = field(default_factory=list)
    params: dict[int, torch.Tensor] = field(default_factory=dict)  # id(user param) -> copy
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # id(kept input) -> clone
    stale: list[str] = field(default_factory=list)  # kept inputs changed in place already
    optimizer: Any = None
    optimizer_why: str = ""
    scaler: Any = None


def _unwrap_compiled(m: nn.Module) -> tuple[nn.Module, bool]:
    inner = getattr(m, "_orig_mod", None)
    if type(m).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        return inner, True
    return m, False


def hold(sentinel: Any, keep: StepKeep, scale: float | None) -> Held:
    """Copy what a replay of ``keep``'s step needs before the step's update overwrites it
    (:class:`~.contract.CopyRefused` above the cap)."""
    held = Held(Copies())
    for c in keep.calls:
        for path, t in _call_leaves(c.args, c.kwargs):
            if any(t is u and _version(t) != v for u, v in c.versions):
                held.stale.append(path)
    for c in keep.calls:
        if id(c.module) in held.roots:
            continue
        inner, compiled = _unwrap_compiled(c.module)
        label = sentinel.naming.names.get(c.module) or type(c.module).__name__
        sharded = sharded_how(inner)
        if sharded:
            raise CopyRefused(
                f"{label} is {sharded}: its weights are {SPLIT_ACROSS_RANKS}, so one rank "
                "cannot replay its step alone (full tracing, without --mode sentinel, names "
                "the layer as the step runs)")
        # (our hooks are not copied: nn.Module.__getstate__ leaves them out while we watch)
        dup = held.copies.module(inner, label)
        for d in (dup._forward_pre_hooks, dup._forward_hooks,
                  dup._forward_pre_hooks_with_kwargs, dup._forward_hooks_with_kwargs):
            for i in sentinel.roots.hook_ids(c.module):
                d.pop(i, None)
        for p in dup.parameters():
            p.grad = None
        held.roots[id(c.module)] = dup
        held.labels[id(c.module)] = label
        if compiled:
            held.compiled.append(label)
        for p, q in zip(inner.parameters(), dup.parameters()):
            held.params[id(p)] = q
    produced = {id(t) for c in keep.calls for _, t in c.outputs}
    leaves = [t for c in keep.calls for _, t in _call_leaves(c.args, c.kwargs)
              if id(t) not in produced]
    held.copies.declare("the kept inputs", sum(t.numel() * t.element_size() for t in leaves))
    for t in leaves:
        held.inputs[id(t)] = t.detach().clone()
    opt = sentinel.optimizer_for_replay()
    scaler = sentinel._scaler_ref() if sentinel._scaler_ref is not None else None
    if opt is not None and not keep.closure:
        try:
            held.optimizer = held.copies.optimizer(opt, held.params)
        except CopyRefused as exc:  # the forward and backward are still replayed
            held.optimizer_why = str(exc)
        except Exception as exc:
            held.optimizer_why = f"the optimizer could not be copied ({type(exc).__name__}: {exc})"
    if keep.scaled and scaler is not None and scaler.is_enabled():
        held.scaler = held.copies.scaler(scaler, scale)
    return held


@contextlib.contextmanager
def _handover(sentinel: Any) -> Any:
    """The sentinel stands aside (its hooks do nothing) while the replay's Hunt is the active
    session, under the replay contract; everything is given back afterwards, also when the
    replay fails."""
    was, sentinel._active = sentinel._active, False
    with _session._LOCK:
        _session._ACTIVE = None
    try:
        with isolated():
            yield
    finally:
        with _session._LOCK:
            _session._ACTIVE = sentinel
        sentinel._active = was


def replay_step(sentinel: Any, keep: StepKeep, held: Held | None, *, collapse: bool,
                optimizer_step: bool = True, preset: Any = None) -> Replay:
    """Replay ``keep``'s step on ``held``'s copies under a full-tracing :class:`Hunt`.
    ``collapse``: a GradScaler skip of this one step is the failure (a collapsing scale).
    ``preset``: a first failure already known (the forward then only provides the culprit's
    snapshot)."""
    out = Replay()
    if not keep.calls or held is None:
        out.error = "no root module call was kept for this step"
        return out
    out.stale = list(held.stale)
    out.compiled = list(held.compiled)
    hunt = Hunt(target=sentinel.target, keep_steps=2, allow_inf=sentinel.allow_inf,
                collapse_scale=math.inf if collapse else sentinel.collapse_scale)
    out.hunt = hunt
    with _handover(sentinel):
        hunt.start()
        try:
            _run(sentinel, hunt, keep, held, out, optimizer_step, preset)
            out.ran = True
        except Exception as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        finally:
            hunt.stop()
    return out


def _run(sentinel: Any, hunt: Hunt, keep: StepKeep, held: Held, out: Replay,
         optimizer_step: bool, preset: Any) -> None:
    for c in keep.calls:
        if id(c.module) in held.roots and not hunt.naming.names.get(held.roots[id(c.module)]):
            hunt.naming.add_root(held.roots[id(c.module)],
                                 primary=sentinel.naming.is_primary(c.module),
                                 label=held.labels[id(c.module)])
    hunt._step = keep.step
    hunt._optimizer_exists = bool(sentinel._optimizers) or sentinel._optimizer_ref is not None
    hunt._begin_step_state()
    if preset is not None:
        hunt.judge.first_failure = preset
    made: dict[int, torch.Tensor] = {}  # id(original output leaf) -> replayed leaf

    def feed(t: torch.Tensor) -> torch.Tensor:
        if id(t) in made:
            return made[id(t)]
        base = held.inputs.get(id(t), t)
        return base.detach().requires_grad_(t.requires_grad)  # a leaf: nothing reaches the user

    seeds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for c in keep.calls:
        args, kwargs = map_tensors(c.args, feed), map_tensors(c.kwargs, feed)
        torch.set_rng_state(c.rng)
        if c.cuda_rng is not None:
            torch.cuda.set_rng_state(c.cuda_rng[0])
        cast = torch.autocast(c.device_type, dtype=c.autocast[1]) if c.autocast[0] else \
            contextlib.nullcontext()
        with cast, torch.set_grad_enabled(c.grad_enabled):
            result = held.roots[id(c.module)](*args, **kwargs)
        leaves = _leaves(result, "output")
        out.outputs.append(leaves)
        for i, ((_p, orig), (_q, new)) in enumerate(zip(c.outputs, leaves)):
            made[id(orig)] = new
            if i in c.out_grads and new.requires_grad:
                seeds.append((orig, new, c.out_grads[i]))
    if preset is not None:
        hunt.snapshots.take(hunt.recorder.data_for(keep.step), hunt.recorder.data_for(keep.step))
        return
    consumed = {id(t) for c in keep.calls for _, t in _call_leaves(c.args, c.kwargs)}
    scale = float(held.scaler._scale) if held.scaler is not None and \
        getattr(held.scaler, "_scale", None) is not None else None
    if keep.loss is not None:
        loss = made.get(id(keep.loss), keep.loss.detach())
        for target, op in keep.targets:
            hunt.loss.on_target(target.detach(), op)
        scaled = keep.scaled and scale is not None
        if scaled:
            hunt.scaler_seen = hunt.cur.step_scaler = True
        hunt.loss._record_loss(loss, "loss")
        if scaled:
            hunt.recorder.scalar(torch.tensor(float(scale), dtype=torch.float64), "scale")
        out.loss = float(loss.detach().float().mean())
    # backward starts where the user's code took over: outputs no later root call consumed
    roots = [(n, g) for o, n, g in seeds if id(o) not in consumed]
    if roots:
        hunt.cur.did_backward = True
        hunt.cur.scaled_backward = keep.scaled
        torch.autograd.backward([n for n, _ in roots], [g.detach() for _, g in roots])
    for pid, q in held.params.items():
        out.grads[pid] = None if q.grad is None else q.grad.detach().clone()
    if not roots:
        out.optimizer = "no backward was kept"
    elif not optimizer_step or held.optimizer is None or keep.closure:
        out.optimizer = "the step uses a closure" if keep.closure else \
            (held.optimizer_why or "no optimizer is known")
    else:
        if held.scaler is not None:
            held.scaler.step(held.optimizer)
            held.scaler.update()
            out.skipped = bool(hunt.steps and hunt.steps[-1].skipped)
        else:
            held.optimizer.step()
        return  # the step ended at the optimizer (or scaler.update)
    hunt.end_step()


# ----------------------------------------------------------------------------- the analyst


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


class TripAnalyst:
    """The sentinel's analysis of a failing step (see the module docstring). ``report``:
    called with the sentinel once it is diagnosed, to write the reports (the pipeline's)."""

    def __init__(self, report: Any = None) -> None:
        self._report = report

    def hold(self, sentinel: Any, trip: Any) -> Held:
        """Inside the user's hook: copies only (declared, capped), no replay."""
        return hold(sentinel, trip.keep, trip.scale)

    def report(self, sentinel: Any) -> None:
        """Write the reports, under the replay contract (the analysis draws random numbers
        and replays modules: the user's generators and modes are put back)."""
        if self._report is not None:
            with isolated():
                self._report(sentinel)

    def analyse(self, sentinel: Any, trip: Any) -> None:
        """After the user's step: replay the trip's step and decide."""
        with isolated():
            self._analyse(sentinel, trip)

    def _analyse(self, sentinel: Any, trip: Any) -> None:
        if trip.kind == "optimizer":
            self._optimizer_made(sentinel, trip)
            return
        keep, problem, d = trip.keep, trip.problem, trip.data
        if trip.refused:  # nothing was copied, nothing replayed: what was seen, no cause
            f = sentinel.judge.first_failure
            if f is not None:
                f.observed = False
                f.detail = f"step {trip.step} was not replayed: {trip.refused}"
            sentinel.notes.append(f"sentinel: step {trip.step} failed ({_what(problem)}) and "
                                  f"was not replayed: {trip.refused}")
            sentinel.finish()
            return
        r = replay_step(sentinel, keep, trip.held, collapse=problem == "collapse")
        ok, why = self._reproduced(sentinel, problem, keep, r)
        sentinel.replay = r
        if ok:
            self._adopt(sentinel, r)
            sentinel.notes.append(
                f"sentinel: step {keep.step} ({_what(problem)}) was replayed with full "
                "tracing, after the step, from the inputs kept by reference and copies of the "
                "parameters as they were before the optimizer step; the replay reproduced it "
                f"({why})")
            if r.compiled:
                sentinel.notes.append(f"the compiled module {', '.join(r.compiled)} was "
                                      "replayed eagerly to name the layer and op inside it")
            if trip.held is not None:
                sentinel.notes.append(f"sentinel: the replay copied {trip.held.copies.describe()}")
            sentinel.finish()
            return
        if r.compiled and sentinel.compiled_only(keep, r.outputs, r.compiled):
            sentinel.finish()
            return
        sentinel.undo_problem(d, keep_mark=True)
        if sentinel.ending:
            sentinel.notes.append(
                f"sentinel: step {keep.step} failed ({_what(problem)}) but its replay did not "
                f"reproduce it ({why}); the run ended before a later step could be traced")
            return
        sentinel.notes.append(
            f"sentinel: step {keep.step} failed ({_what(problem)}) but its replay did not "
            f"reproduce it ({why}); full tracing from step {sentinel.step} on")
        sentinel.switch_to_tracing()

    @staticmethod
    def _reproduced(sentinel: Any, problem: str | None, keep: StepKeep,
                    r: Replay) -> tuple[bool, str]:
        if not r.ran:
            return False, f"the replay raised {r.error}" if r.hunt is not None else str(r.error)
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
            opt = sentinel.optimizer_for_replay()
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

    @staticmethod
    def _adopt(sentinel: Any, r: Replay) -> None:
        h = r.hunt
        assert h is not None
        sentinel.judge.first_failure = h.first_failure
        sentinel.judge.problem = h.problem
        sentinel.snapshot = h.snapshot
        sentinel.failure_extra.update(h.failure_extra)
        for fact in h.facts:
            if fact not in sentinel.judge.facts:
                sentinel.judge.facts.append(fact)

    @staticmethod
    def _optimizer_made(sentinel: Any, trip: Any) -> None:
        failure = sentinel.judge.first_failure
        step = failure.step if failure is not None else trip.step
        name = failure.tensor if failure is not None else "a parameter"
        keep = trip.keep
        if keep is not None and trip.held is not None:
            preset = type(failure)(step=keep.step, phase="optimizer", module=failure.module,
                                   tensor=failure.tensor, stats=failure.stats) \
                if failure is not None else None
            r = replay_step(sentinel, keep, trip.held, collapse=False, preset=preset)
            sentinel.replay = r
            if r.hunt is not None:
                sentinel.snapshot = r.hunt.snapshot
        others = f" (and {len(trip.bad) - 1} more)" if len(trip.bad) > 1 else ""
        where = (f"; the forward of step {keep.step} was replayed on the updated weights for "
                 "the op-level zoom" if keep is not None and trip.held is not None else "")
        sentinel.notes.append(
            f"sentinel: the optimizer step at step {step} made {name}{others} non-finite from "
            f"finite gradients; found when step {trip.step} failed ({_what(trip.problem)}), by "
            "one pass over the weights; the update itself was not replayed (it overwrote what "
            f"it read){where}")
        if trip.refused:
            sentinel.notes.append(f"sentinel: {trip.refused}")
        sentinel.finish()
