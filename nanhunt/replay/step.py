"""Replay one kept training step with full tracing, on copies: the root modules' calls on their
kept inputs (eagerly, for compiled ones), backward from the kept output gradients, and the
optimizer step on a copy of the optimizer (and of the GradScaler)."""

from __future__ import annotations

import contextlib
import copy
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nanhunt.capture import session as _session
from nanhunt.capture._util import _call_leaves, _leaves, _version, map_tensors
from nanhunt.capture.keep import StepKeep
from nanhunt.capture.session import Hunt


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


def _unwrap_compiled(m: nn.Module) -> tuple[nn.Module, bool]:
    inner = getattr(m, "_orig_mod", None)
    if type(m).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        return inner, True
    return m, False


def _copy_root(root: nn.Module, hook_ids: list[int], owner: Any) -> tuple[nn.Module, bool]:
    """A deep copy of the root (its eager module when compiled) without our hooks or grads;
    ``owner`` (the part whose methods are the hooks) is not copied with them."""
    inner, compiled = _unwrap_compiled(root)
    dup = copy.deepcopy(inner, {id(owner): owner})
    if not compiled:
        for d in (dup._forward_pre_hooks, dup._forward_hooks,
                  dup._forward_pre_hooks_with_kwargs, dup._forward_hooks_with_kwargs):
            for i in hook_ids:
                d.pop(i, None)
    for p in dup.parameters():
        p.grad = None
    return dup, compiled


def _optimizer_copy(opt: Any, pmap: dict[int, torch.Tensor]) -> tuple[Any, str]:
    groups = []
    for g in opt.param_groups:
        if any(id(p) not in pmap for p in g["params"]):
            return None, "the optimizer also steps parameters outside the replayed modules"
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [pmap[id(p)] for p in g["params"]]})
    try:
        dup = type(opt)(groups)
        dup.load_state_dict(copy.deepcopy(opt.state_dict()))  # never the user's own state
    except Exception as exc:
        return None, f"the optimizer could not be copied ({type(exc).__name__}: {exc})"
    return dup, ""


def _scaler_copy(scaler: Any, scale: float | None) -> Any:
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    dup = copy.copy(scaler)
    dup._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
    if scaler._scale is not None:
        value = scale if scale is not None else float(scaler._scale)
        dup._scale = torch.full_like(scaler._scale, value)
        dup._growth_tracker = scaler._growth_tracker.clone()
    return dup


@contextlib.contextmanager
def _handover(sentinel: Any) -> Any:
    """The sentinel stands aside (its hooks do nothing) while the replay's Hunt is the active
    session; everything is given back afterwards, also when the replay fails."""
    sentinel._active = False
    with _session._LOCK:
        _session._ACTIVE = None
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() \
        and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)  # the user's random stream continues untouched
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        with _session._LOCK:
            _session._ACTIVE = sentinel
        sentinel._active = True


def replay_step(sentinel: Any, keep: StepKeep, *, scale: float | None, collapse: bool,
                optimizer_step: bool = True, preset: Any = None) -> Replay:
    """Replay ``keep``'s step under a full-tracing :class:`Hunt`. ``collapse``: a GradScaler
    skip of this one step is the failure (a collapsing scale). ``preset``: a first failure
    already known (the forward then only provides the culprit's snapshot)."""
    out = Replay()
    if not keep.calls:
        out.error = "no root module call was kept for this step"
        return out
    for c in keep.calls:
        for path, t in _call_leaves(c.args, c.kwargs):
            if any(t is u and _version(t) != v for u, v in c.versions):
                out.stale.append(path)
    hunt = Hunt(target=sentinel.target, keep_steps=2, allow_inf=sentinel.allow_inf,
                collapse_scale=math.inf if collapse else sentinel.collapse_scale)
    out.hunt = hunt
    with _handover(sentinel):
        hunt.start()
        try:
            _run(sentinel, hunt, keep, out, scale, optimizer_step, preset)
            out.ran = True
        except Exception as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        finally:
            hunt.stop()
    return out


def _run(sentinel: Any, hunt: Hunt, keep: StepKeep, out: Replay, scale: float | None,
         optimizer_step: bool, preset: Any) -> None:
    copies: dict[int, nn.Module] = {}
    pmap: dict[int, torch.Tensor] = {}
    for c in keep.calls:
        if id(c.module) in copies:
            continue
        dup, compiled = _copy_root(c.module, sentinel.roots.hook_ids(c.module), sentinel.roots)
        label = sentinel.naming.names.get(c.module) or type(c.module).__name__
        if compiled:
            out.compiled.append(label)
        copies[id(c.module)] = dup
        hunt.naming.add_root(dup, primary=sentinel.naming.is_primary(c.module), label=label)
        inner, _ = _unwrap_compiled(c.module)
        for p, q in zip(inner.parameters(), dup.parameters()):
            pmap[id(p)] = q
    hunt._step = keep.step
    hunt._optimizer_exists = bool(sentinel._optimizers) or sentinel._optimizer_ref is not None
    hunt._begin_step_state()
    if preset is not None:
        hunt.judge.first_failure = preset
    made: dict[int, torch.Tensor] = {}  # id(original output leaf) -> replayed leaf

    def feed(t: torch.Tensor) -> torch.Tensor:
        if id(t) in made:
            return made[id(t)]
        return t.detach().requires_grad_(t.requires_grad)  # a leaf: nothing reaches the user's

    seeds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for c in keep.calls:
        args, kwargs = map_tensors(c.args, feed), map_tensors(c.kwargs, feed)
        torch.set_rng_state(c.rng)
        if c.cuda_rng is not None:
            torch.cuda.set_rng_state(c.cuda_rng[0])
        cast = torch.autocast(c.device_type, dtype=c.autocast[1]) if c.autocast[0] else \
            contextlib.nullcontext()
        with cast, torch.set_grad_enabled(c.grad_enabled):
            result = copies[id(c.module)](*args, **kwargs)
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
    for pid, q in pmap.items():
        out.grads[pid] = None if q.grad is None else q.grad.detach().clone()
    opt = sentinel.optimizer_for_replay()
    scaler = sentinel._scaler_ref() if sentinel._scaler_ref is not None else None
    if not roots:
        out.optimizer = "no backward was kept"
    elif not optimizer_step or opt is None or keep.closure:
        out.optimizer = "the step uses a closure" if keep.closure else "no optimizer is known"
    else:
        dup, why = _optimizer_copy(opt, pmap)
        out.optimizer = why
        if dup is not None:
            if keep.scaled and scaler is not None and scaler.is_enabled():
                sc = _scaler_copy(scaler, scale)
                sc.step(dup)
                sc.update()
                out.skipped = bool(hunt.steps and hunt.steps[-1].skipped)
            else:
                dup.step()
            return  # the step ended at the optimizer (or scaler.update)
    hunt.end_step()
