"""Module observer: global forward pre/post hooks that record each module call's inputs and
outputs (and hook the outputs' gradients through the autograd observer)."""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _M

from nanhunt import stats as _stats
from nanhunt.capture._util import (
    _DROPOUT,
    _autocast_state,
    _call_leaves,
    _in_backward,
    _leaves,
    _safe,
    _skip,
    _version,
    module_caller,
)
from nanhunt.capture.compiled import compiled_boundary, global_forward_hook
from nanhunt.capture.state import Part, _Call, _Frame, _Meta


class ModuleObserver(Part):
    """Every module call of a traced step: a frame at the pre-hook, rows for the inputs nobody
    produced (the batch, code between modules) and for the outputs at the post-hook, and the
    call's arguments kept by reference for the culprit snapshot."""

    def __init__(self, session: Any) -> None:
        super().__init__(session)
        self._handles: list[Any] = []
        self.compiled: set[str] = set()  # compiled modules that ran (seen at their boundary)
        # step -> modules whose forward activation checkpointing recomputed in its backward
        self.recomputed: dict[int, set[str]] = {}

    def install(self, stack: Any) -> None:
        self.set_hooks(True)
        stack.callback(self.set_hooks, False)
        # compiled modules run without our hooks inside, recorded at their boundary
        stack.enter_context(compiled_boundary(self._on_pre, self._on_post, self.compiled,
                                              self.s.naming))

    def set_hooks(self, on: bool) -> None:
        """Global module hooks slow every module call, so sampled mode drops them between
        sampled steps."""
        if on and not self._handles:
            self._handles = [
                _M.register_module_forward_pre_hook(self._on_pre),
                global_forward_hook(self._on_post),
            ]
        elif not on:
            for h in self._handles:
                h.remove()
            self._handles = []

    @_safe
    def _on_pre(self, module: nn.Module, args: tuple) -> None:
        if not self.s._active or _skip() or self.s._foreign_thread():
            return
        if _in_backward():  # activation-checkpoint recompute: not a call
            if self.s._full:
                name = self.s.naming.names.get(module)
                if name is not None:
                    self.recomputed.setdefault(self.s._step, set()).add(name)
                    for old in [k for k in self.recomputed if k < self.s._step - 1]:
                        del self.recomputed[old]
            return
        if not self.cur.frames:
            self.s._end_step_if_over()
            if module.training and torch.is_grad_enabled():
                self.cur.trains = True
        if self.s._target_auto:
            self.s._resolve_target(module)
        if not self.s._full:
            return
        name = self.s.naming.name_of(module, self.cur.frames)
        call = len(self.cur.calls)
        parent = self.cur.frames[-1].call if self.cur.frames else None
        self.cur.calls.append(_Call(call, module, name, parent,
                                    site=module_caller() if parent is None else None))
        versions = [(t, _version(t)) for t in args if isinstance(t, torch.Tensor)]
        self.cur.frames.append(_Frame(module, name, call, self.cur.next_order(), versions))

    def _pop_frame(self, module: nn.Module) -> _Frame | None:
        while self.cur.frames:
            frame = self.cur.frames.pop()
            if frame.module is module:
                return frame
        return None

    @_safe
    def _on_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        s = self.s
        if not s._active or not s._full or _skip() or s._foreign_thread():
            return
        if _in_backward():
            self._recomputed(module, output)
            return
        cur, rec = s.cur, s.recorder  # (the step cannot end before the last line)
        frame = self._pop_frame(module)
        if frame is None:
            return
        call = cur.calls[frame.call]
        name, parent = frame.name, call.parent
        mutated_ids = {id(t) for t, v in frame.versions if _version(t) != v}
        leaves = _call_leaves(args, kwargs)
        grad_on = torch.is_grad_enabled()
        for path, t in leaves:
            if not _stats.summarizable(t):
                continue
            idx = cur.lookup(t)
            if idx is not None:
                m = rec.metas[idx]
                if m.role == "input" and m.order > frame.order and idx >= rec.flushed:
                    # made outside this call and first seen by an inner one: it enters here
                    self._describe_input(m, frame, call, path, t)
                m.consumers.append(frame.call)
                m.consumer_paths.append(path)
                continue
            mutated = id(t) in mutated_ids
            meta = _Meta(
                step=s._step, order=frame.order, phase="forward", module="", tensor=path,
                role="input", dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
                owner=name, consumers=[] if mutated else [frame.call],
                consumer_paths=[] if mutated else [path],
            )
            if mutated:  # changed in place by this very call: its output, in effect
                call.mutated_inputs.append(path)
                meta.order, meta.module, meta.role = cur.next_order(), name, "output"
                meta.tensor, meta.producer, meta.parent = f"{path} (changed in place)", \
                    frame.call, parent
                meta.allowed, meta.mutated = s._allowed(name, path), True
            else:
                self._describe_input(meta, frame, call, path, t)
            idx = rec.queue(t, meta)
            cur.remember(t, idx)
            if grad_on and t.requires_grad:
                s.autograd.hook_grad(t, idx)
        if isinstance(module, _DROPOUT) and self._alias_through(args, output):
            return
        outs = _leaves(output, "output")
        for path, t in outs:
            if not _stats.summarizable(t):
                continue
            idx = cur.lookup(t)
            if idx is not None:
                m = rec.metas[idx]
                if m.producer != frame.call and m.role == "output":
                    # a container passing its child's output through: the same values
                    m.also_producers.append(frame.call)
                    m.also_owners.append(name)
                    call.output_rows.append(idx)
                    continue
                if m.producer == frame.call:
                    continue
                if frame.call in m.consumers:  # returns its own input (nn.Identity): the same
                    m.also_producers.append(frame.call)
                    call.output_rows.append(idx)
                    continue
            meta = _Meta(
                step=s._step, order=cur.next_order(), phase="forward", module=name,
                tensor=path, role="output", dtype=str(t.dtype).removeprefix("torch."),
                shape=tuple(t.shape), owner=name, producer=frame.call, parent=parent,
                allowed=s._allowed(name, path),
            )
            idx = rec.queue(t, meta)
            call.output_rows.append(idx)
            cur.remember(t, idx)
            if grad_on and t.requires_grad:
                s.autograd.hook_grad(t, idx)
        if s.keep_tensors and grad_on:
            call.args, call.kwargs = args, kwargs
            dev = outs[0][1].device.type if outs else "cpu"
            call.autocast = _autocast_state(dev)
            if call.autocast[0]:
                s.autocast_seen = True
        s.devices.add(outs[0][1].device.type if outs else "cpu")
        if parent is None and not grad_on and not (cur.did_backward or s._saw_optimizer
                                                   or s.scaler_seen or s._optimizer_exists
                                                   or s._trained):
            # inference only: each call of the model is a step (with an optimizer built, a
            # no-grad call is evaluation between training steps, as a framework's sanity check)
            s._end_step()

    @torch.no_grad()
    def _recomputed(self, module: nn.Module, output: Any) -> None:
        """A forward that activation checkpointing runs again inside backward. Its call was
        counted and its ranges recorded in the forward, so the recomputation is neither: one
        cheap finiteness row per output (a flag for NaN, one for inf, the largest finite |x|),
        phase ``backward``, so that a value only the recomputation makes non-finite (a forward
        that does not give the same values twice) is attributed to its module. The judge
        ignores it where the forward's own output was non-finite already."""
        name = self.s.naming.names.get(module)
        if name is None:
            return
        for path, t in _leaves(output, "output"):
            if not _stats.summarizable(t) or t.numel() == 0:
                continue
            a = _stats.local(t).detach().abs().amax().double()
            row = torch.zeros(_stats.ROW_LEN, dtype=torch.float64, device=a.device)
            row[1] = torch.isnan(a).double()
            row[2] = torch.isinf(a).double()
            row[5] = torch.where(torch.isfinite(a), a, 0.0)
            row[6] = math.inf
            self.rec.pending_rows.append(row)
            self.rec.metas.append(_Meta(
                step=self.s._step, order=self.cur.next_order(), phase="backward", module=name,
                tensor=f"{path} (recomputed)", role="recomputed",
                dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape), owner=name,
                approx=weakref.ref(t)))

    def _alias_through(self, args: tuple, output: Any) -> bool:
        """Dropout only masks and rescales by 1/(1-p): its output's values add nothing to its
        input's, so the output is tied to the input's record instead of summarised (dropout
        outputs and their gradients are a large share of a transformer's tensors)."""
        if not isinstance(output, torch.Tensor) or len(args) != 1:
            return False
        idx = self.cur.lookup(args[0]) if isinstance(args[0], torch.Tensor) else None
        if idx is None:
            return False
        self.cur.remember(output, idx)
        return True

    def _describe_input(self, m: _Meta, frame: _Frame, call: _Call, path: str,
                        t: torch.Tensor) -> None:
        """Blame for an input that no module produced: the batch, or its caller's own code."""
        parent = call.parent
        parent_name = self.cur.calls[parent].name if parent is not None else ""
        data = parent is None and t.grad_fn is None and not t.requires_grad
        m.order = frame.order
        m.phase = "data" if data else "forward"
        m.module = frame.name if data else parent_name
        m.tensor = path if data else f"{path} of {frame.name}"
        m.parent = parent
        m.allowed = self.s._allowed(frame.name, path) or self.s._allowed(parent_name, path)
