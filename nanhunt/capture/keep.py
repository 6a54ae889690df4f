"""The sentinel's cheap parts: what a replay of the step needs, kept by reference (the root
modules' inputs, RNG state, output gradients, the loss and its targets), and the one fused
gradient check before the optimizer step."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _M
from torch.optim import optimizer as _O

from nanhunt import stats as _stats
from nanhunt._patching import patch
from nanhunt.capture._util import (
    _autocast_state,
    _call_leaves,
    _foreach_norm,
    _in_backward,
    _leaves,
    _safe,
    _skip,
    _version,
)
from nanhunt.capture.compiled import compiled_boundary
from nanhunt.capture.loss import LossObserver
from nanhunt.capture.shards import is_sharded
from nanhunt.capture.state import Part
from nanhunt.contract import is_fsdp1


@dataclass
class RootCall:
    """One call of a root module (a module no other module contains) in the step."""

    module: nn.Module
    args: Any
    kwargs: Any
    device_type: str
    autocast: tuple[bool, torch.dtype | None]
    grad_enabled: bool
    rng: torch.Tensor  # CPU generator state when the call began
    cuda_rng: list[torch.Tensor] | None
    versions: list[tuple[torch.Tensor, int]]  # in-place edits after the call make inputs stale
    outputs: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    out_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # output leaf -> its grad


@dataclass
class StepKeep:
    """Everything a replay of one step needs, held by reference (no copies)."""

    step: int
    calls: list[RootCall] = field(default_factory=list)
    loss: torch.Tensor | None = None  # the unscaled loss given to backward / scaler.scale
    targets: list[tuple[torch.Tensor, str]] = field(default_factory=list)  # (target, loss op)
    closure: bool = False  # the optimizer ran a closure (LBFGS): not replayed
    grad_checked: bool = False  # the gradient check ran (no GradScaler did it)
    scaled: bool = False  # the loss went through GradScaler.scale

    def nbytes(self) -> int:
        """Bytes these references keep alive (shared storage counted once)."""
        seen: dict[int, int] = {}
        tensors: list[torch.Tensor] = []
        for c in self.calls:
            tensors += [t for _, t in _call_leaves(c.args, c.kwargs)]
            tensors += list(c.out_grads.values())
        tensors += [t for t, _ in self.targets]
        for t in tensors:
            if t.layout == torch.strided and t.device.type != "meta":
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())


#: the roots being watched: id(root) -> (weak reference to it, its watch, our hook ids). The
#: hooks on a user's module are the module-level functions below, which hold nothing: the
#: module stays picklable and deep-copyable, and a pickle of it carries none of our hooks
_WATCHED: dict[int, tuple[weakref.ref, RootWatch, list[int]]] = {}
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _watch_of(module: nn.Module) -> RootWatch | None:
    entry = _WATCHED.get(id(module))
    return entry[1] if entry is not None and entry[0]() is module else None


def _root_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    watch = _watch_of(module)
    if watch is not None:
        watch._on_pre(module, args, kwargs)


def _root_post_hook(module: nn.Module, args: tuple, output: Any) -> None:
    watch = _watch_of(module)
    if watch is not None:
        watch._on_post(module, args, output)


def _without_our_hooks(original: Any) -> Any:
    """``nn.Module.__getstate__`` while a sentinel watches roots: a pickle or deep copy of a
    watched module is what it would be without nanhunt (none of our hook entries)."""

    def __getstate__(self: nn.Module) -> Any:
        state = original(self)
        entry = _WATCHED.get(id(self))
        if entry is None or entry[0]() is not self or not isinstance(state, dict):
            return state
        ours = set(entry[2])
        for key in _HOOK_TABLES:
            table = state.get(key)
            if table and ours.intersection(table):
                state[key] = OrderedDict((k, v) for k, v in table.items() if k not in ours)
        return state

    return __getstate__


class RootWatch(Part):
    """Keeps each root module call's inputs, autocast and RNG state and output gradients for
    the replay. With the model given, its own forward hooks; otherwise global module hooks for
    the first step only, which learn the roots, then hooks on those roots. The hooks on the
    roots are module-level functions that find this watch in a registry (:data:`_WATCHED`):
    nothing of the session is stored on the user's module."""

    def __init__(self, session: Any) -> None:
        super().__init__(session)
        self._global: list[Any] = []
        self._local: dict[int, tuple[weakref.ref, list[Any]]] = {}
        self._depth = 0

    def install(self, stack: Any) -> None:
        patch(stack, nn.Module, "__getstate__", _without_our_hooks)
        stack.callback(self._remove)
        model = self.s._model_ref() if self.s._model_ref is not None else None
        if model is not None:
            self.watch_root(model)
        # also with a model: the step may call a wrapper of it (torch.compile's, DDP); in the
        # first step they also find the format autocast uses inside a forward
        self._global = [
            _M.register_module_forward_pre_hook(self._on_global_pre),
            _M.register_module_forward_hook(self._on_global_post),
        ]
        # a compiled module's call runs without these global hooks (torch warns into the
        # user's stderr while any exist, and Dynamo would trace them): seen at its boundary
        stack.enter_context(compiled_boundary(self._boundary_pre, self._boundary_post, set(),
                                              self.s.naming))

    def _boundary_pre(self, module: nn.Module, args: tuple) -> None:
        if self._global:  # (only while the global hooks are in: the first step)
            self._on_global_pre(module, args)

    def _boundary_post(self, module: nn.Module, args: tuple, kwargs: Any, output: Any) -> None:
        if self._global:
            self._on_global_post(module, args, output)

    def _remove(self) -> None:
        self.drop_global()
        for key, (_ref, handles) in self._local.items():
            for h in handles:
                h.remove()
            entry = _WATCHED.get(key)
            if entry is not None and entry[1] is self:
                del _WATCHED[key]
        self._local = {}

    def drop_global(self) -> None:
        for h in self._global:
            h.remove()
        self._global = []

    def hook_ids(self, module: nn.Module) -> list[int]:
        """Ids of this part's hooks on ``module`` (a copy must not carry them)."""
        entry = self._local.get(id(module))
        return [h.id for h in entry[1]] if entry else []

    def watch_root(self, root: nn.Module) -> bool:
        """Hook ``root``'s own calls; False when they are hooked already."""
        if id(root) in self._local and self._local[id(root)][0]() is root:
            return False
        handles = [root.register_forward_pre_hook(_root_pre_hook, with_kwargs=True),
                   root.register_forward_hook(_root_post_hook)]
        ref = weakref.ref(root)
        self._local[id(root)] = (ref, handles)
        _WATCHED[id(root)] = (ref, self, [h.id for h in handles])
        return True

    # the first step without a model: global hooks learn the roots (modules called while no
    # other module runs); their own hooks record the calls from then on
    def _on_global_pre(self, module: nn.Module, args: tuple) -> None:
        if _skip() or threading.get_ident() != self.s._thread:
            return  # (another thread's calls are not the training step's)
        if self.s._target_auto and self.s._active:
            # autocast entered inside a forward (accelerate wraps ``model.forward``) is seen
            # only by the modules inside it
            self.s._resolve_target(module)
        if self._depth == 0 and self.s._active and not _in_backward():
            self.s.naming.name_of(module, [])  # named as full tracing names it
            if self.watch_root(module):
                # its own pre-hook joins from the next call (this call's hooks are fixed);
                # this first call's keyword arguments are not seen
                self._on_pre(module, args, {})
        self._depth += 1

    def _on_global_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not _skip() and threading.get_ident() == self.s._thread:
            self._depth = max(0, self._depth - 1)

    def step_begun(self) -> None:
        self._depth = 0
        if self._global and self._local and self.s._step > 0:
            self.drop_global()  # the roots are known

    @_safe
    def _on_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if _skip():
            return
        s = self.s
        if not s._active or _in_backward() or s._in_root is not None \
                or threading.get_ident() != s._thread:
            return
        s._end_step_if_over()
        s._step_boundary(module, args)  # a failing step's analysis runs here, between steps
        if s._target_auto:  # the format the run uses, as full tracing decides it
            for m in module.modules():
                s._resolve_target(m)
        s._in_root = module
        keep = s.keep
        leaves = _call_leaves(args, kwargs)
        dev = next((t.device for _, t in leaves), torch.device("cpu"))
        cuda_rng = [torch.cuda.get_rng_state(dev)] if dev.type == "cuda" else None
        keep.calls.append(RootCall(
            module=module, args=args, kwargs=dict(kwargs), device_type=dev.type,
            autocast=_autocast_state(dev.type), grad_enabled=torch.is_grad_enabled(),
            rng=torch.get_rng_state(), cuda_rng=cuda_rng,
            versions=[(t, _version(t)) for _, t in leaves]))

    @_safe
    def _on_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if _skip():
            return
        s = self.s
        if s._in_root is not module or threading.get_ident() != s._thread:
            return
        s._in_root = None
        keep = s.keep
        if not keep.calls or keep.calls[-1].module is not module:
            return
        call = keep.calls[-1]
        call.outputs = _leaves(output, "output")
        grad_on = torch.is_grad_enabled()
        for i, (_path, t) in enumerate(call.outputs):
            if grad_on and t.requires_grad:
                s.cur.grad_handles.append(t.register_hook(
                    lambda g, call=call, i=i: call.out_grads.__setitem__(i, g)))
        s.devices.add(call.device_type)
        if call.autocast[0]:
            s.autocast_seen = True
        if not grad_on and not (s.cur.did_backward or s._saw_optimizer or s.scaler_seen
                                or s._optimizer_exists or s._trained):
            s._end_step()  # inference only: each call of the model is a step


class KeptLoss(LossObserver):
    """The loss observer of full tracing, reduced to the loss's value (a device scalar: its
    finiteness and the timeline) and references to the loss and its targets for the replay."""

    def _record_loss(self, loss: torch.Tensor, role: str) -> None:
        if self.s._full:  # (full tracing after a replay that did not reproduce)
            super()._record_loss(loss, role)
        elif _stats.summarizable(loss):
            self.rec.scalar(loss.detach().float().mean() if loss.numel() != 1 else loss,
                            "loss")
        keep = self.s.keep
        keep.loss = loss
        keep.scaled = self.cur.step_scaler
        keep.targets = []
        self._walk_targets(loss, keep)

    @staticmethod
    def _walk_targets(loss: torch.Tensor, keep: StepKeep) -> None:
        todo, seen = [loss.grad_fn], 0
        while todo and seen < 8:
            node = todo.pop(0)
            if node is None:
                continue
            seen += 1
            name = type(node).__name__
            if "Loss" in name or "Entropy" in name:
                target = getattr(node, "_saved_target", None)
                if isinstance(target, torch.Tensor) and _stats.summarizable(target):
                    op = name.removesuffix("Backward0").removesuffix("Backward")
                    keep.targets.append((target, op))
            todo.extend(fn for fn, _ in node.next_functions)


class GradCheck(Part):
    """One fused norm per device over the gradients the optimizer is about to apply: the
    step's gradient norm, non-finite when any gradient is (the sentinel then looks closer)."""

    def install(self, stack: Any) -> None:
        # registered before the optimizer observer's hooks: its pre-hook's transfer carries the
        # norm, its post-hook ends the step
        stack.enter_context(_O.register_optimizer_step_pre_hook(self._on_opt_pre))
        stack.enter_context(_O.register_optimizer_step_post_hook(self._on_opt_post))

    @_safe
    def _on_opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The weights' in-place edit counters after the update: a weight found non-finite
        later whose counter has not moved since holds what an optimizer step wrote."""
        s = self.s
        if s._active and not s._foreign_thread():
            s._versions.update({id(p): (_version(p), s._step) for g in optimizer.param_groups
                                for p in g["params"]})

    @_safe
    def _on_opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        s = self.s
        if not s._active or s._full or s._foreign_thread():  # (full tracing: row by row)
            return
        s._optimizers.setdefault(id(optimizer), weakref.ref(optimizer))
        if s.cur.step_scaler:
            return  # GradScaler's found_inf has checked these gradients already
        # (args[0] is the optimizer; a closure comes as closure= or LBFGS's first argument)
        if callable(kwargs.get("closure")) or (len(args) > 1 and callable(args[1])):
            s.keep.closure = True
            return  # the closure's backward has not run yet: checked at its transfer
        self.check([p for g in optimizer.param_groups for p in g["params"]])

    @torch.no_grad()
    def check(self, params: list[torch.Tensor]) -> None:
        s = self.s
        fsdp1 = self._fsdp1_params()
        whole: dict[torch.device, list[torch.Tensor]] = {}
        shards: dict[torch.device, list[torch.Tensor]] = {}
        for p in params:
            g = p.grad
            if g is not None and not g.is_sparse and _stats.summarizable(g):
                # a shard's sum of squares is this rank's part of the whole's (FSDP1, FSDP2,
                # tensor parallel): the recorder adds the ranks' parts up
                sharded = is_sharded(g) or id(p) in fsdp1
                (shards if sharded else whole).setdefault(g.device, []).append(g)
        total, shard_total = _sumsq(whole), _sumsq(shards)
        if s.cur.clip_norm is None:  # (a clip_grad_norm_ of the script's measured it whole)
            if total is not None:
                s.cur.clip_norm = total.sqrt()  # the optimizer observer files it with the step
            if shard_total is not None:
                s.recorder.scalar(shard_total, "grad_sumsq_sharded")
        s.keep.grad_checked = total is not None or shard_total is not None

    def _fsdp1_params(self) -> set[int]:
        """The parameters FSDP1 units manage (their gradients are shards), found once."""
        found = getattr(self, "_fsdp1", None)
        if found is None:
            found = set()
            for ref, _label in list(self.s.naming.roots):
                root = ref()
                for m in root.modules() if root is not None else ():
                    if is_fsdp1(m):
                        found.update(id(p) for p in m.parameters())
            if self.s.naming.roots:
                self._fsdp1 = found
        return found


def _sumsq(by_device: dict[torch.device, list[torch.Tensor]]) -> torch.Tensor | None:
    """The sum of squares of tensors grouped by device, one fused norm per device."""
    total = None
    for grads in by_device.values():
        part = torch.stack(_foreach_norm(grads, 2.0)).double().pow(2).sum()
        total = part if total is None else total + part.to(total.device)
    return total


def grad_rows(session: Any, params: list[torch.Tensor]) -> list[tuple[torch.Tensor, str, str]]:
    """The parameters whose gradients hold NaN/inf, exactly (at a failure only)."""
    bad = []
    for p in params:
        g = p.grad
        if g is not None and not g.is_sparse and _stats.summarizable(g) and \
                not bool(torch.isfinite(g).all()):
            bad.append((p, *session.naming.param_names.get(p, ("<param>", ""))))
    return bad
