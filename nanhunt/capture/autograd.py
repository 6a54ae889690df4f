"""Autograd observer: hooks on recorded outputs' gradients, and post-accumulate hooks on the
parameters (their ``.grad`` once backward has summed it)."""

from __future__ import annotations

from typing import Any

import torch

from nanhunt import stats as _stats
from nanhunt.capture._util import _safe, _skip
from nanhunt.capture.shards import is_sharded
from nanhunt.capture.state import Part, _Meta

#: autograd nodes walked per backward to find down-casts (a bound on the cost per step)
_MAX_GRAPH_NODES = 50_000


class AutogradObserver(Part):
    """Gradient rows: one per hooked forward tensor (``grad_output``/``grad_input``, blamed on
    the module that consumed it) and one per parameter gradient; a step's gradient-norm
    parameters are collected here too."""

    def __init__(self, session: Any) -> None:
        super().__init__(session)
        self._param_hooks: list[Any] = []

    def install(self, stack: Any) -> None:
        stack.callback(self._remove_param_hooks)

    def hook_param(self, p: torch.Tensor) -> None:
        """Called by the naming for every parameter of a named root, once."""
        self._param_hooks.append(p.register_post_accumulate_grad_hook(self._on_param_grad))

    def _remove_param_hooks(self) -> None:
        for h in self._param_hooks:
            h.remove()
        self._param_hooks = []

    def hook_grad(self, t: torch.Tensor, idx: int) -> None:
        self.cur.grad_handles.append(t.register_hook(lambda g, idx=idx: self._on_grad(idx, g)))

    def hook_casts(self, loss: torch.Tensor) -> None:
        """Hook the backward of every down-cast on the way to a recorded module output (the
        ``ToCopyBackward0`` of autocast's or the user's ``.float()``): there a gradient computed
        in the wider dtype is cast to the output's narrower one, and values flush to zero. The
        hook counts, on the device, what was already zero, what the cast flushed and what it
        left subnormal (DESIGN.md §2: exact zeros made by the cast are flushed)."""
        producers: dict[int, str] = {}
        for idx, _version, ref in self.cur.seen.values():
            t = ref() if callable(ref) and not isinstance(ref, torch.Tensor) else ref
            if not isinstance(t, torch.Tensor) or t.grad_fn is None or idx >= len(self.rec.metas):
                continue
            meta = self.rec.metas[idx]
            if meta.role == "output" and meta.owner and t.element_size() < 4:
                producers[id(t.grad_fn)] = meta.owner
        if not producers or loss.grad_fn is None:
            return
        todo, seen = [loss.grad_fn], set()
        while todo and len(seen) < _MAX_GRAPH_NODES:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            nxt = node.next_functions
            if type(node).__name__ == "ToCopyBackward0" and nxt and nxt[0][0] is not None:
                owner = producers.get(id(nxt[0][0]))
                if owner is not None:
                    self.cur.grad_handles.append(node.register_hook(
                        lambda gi, go, owner=owner: self._on_cast(owner, gi, go)))
            todo.extend(fn for fn, _ in nxt)

    @_safe
    @torch.no_grad()
    def _on_cast(self, owner: str, grad_inputs: Any, grad_outputs: Any) -> None:
        if not self.s._active or not grad_inputs or not grad_outputs:
            return
        low, wide = grad_inputs[0], grad_outputs[0]
        if not (isinstance(low, torch.Tensor) and isinstance(wide, torch.Tensor)) \
                or low.shape != wide.shape or not low.is_floating_point() \
                or low.element_size() >= wide.element_size():
            return  # not a narrowing cast of a gradient
        nonzero = wide != 0
        zero_after = low == 0
        tiny = torch.finfo(low.dtype).tiny  # the smallest normal
        counts = torch.stack([
            (~nonzero).sum(),
            (nonzero & zero_after).sum(),
            ((low.abs() < tiny) & ~zero_after).sum(),
        ]).double()
        amax = wide.abs().nan_to_num(0.0, 0.0, 0.0).amax().double().reshape(1)
        self.rec.cast_counts(owner, low.numel(), torch.cat([counts, amax]),
                             str(wide.dtype).removeprefix("torch."),
                             str(low.dtype).removeprefix("torch."))

    def _grad_meta(self, idx: int, grad: torch.Tensor, step: int) -> _Meta:
        src = self.rec.metas[idx]
        call = src.consumers[-1] if src.consumers else src.parent
        if src.consumers:
            tensor = "grad_" + src.consumer_paths[-1]
        else:
            tensor = f"grad of {src.owner}.{src.tensor}"
        blamed = self.cur.calls[call].name if call is not None else ""
        return _Meta(
            step=step, order=self.cur.next_order(), phase="backward", module=blamed,
            tensor=tensor,
            role="grad_input" if src.consumers else "grad_output",
            dtype=str(grad.dtype).removeprefix("torch."), shape=tuple(grad.shape),
            owner=src.owner if src.role == "output" else "", producer=None, parent=None,
            also_owners=list(src.also_owners), call=call,
        )

    @_safe
    def _on_grad(self, idx: int, grad: torch.Tensor) -> None:
        if not self.s._active or idx >= len(self.rec.metas) or not _stats.summarizable(grad) \
                or _skip():
            return
        self.cur.did_backward = True
        self.rec.queue(grad, self._grad_meta(idx, grad, self.s._step))
        if self.s.keep_tensors:
            self.cur.grads[idx] = grad

    @_safe
    def _on_param_grad(self, p: torch.Tensor) -> None:
        if not self.s._active or p.grad is None or _skip():
            return
        self.cur.did_backward = True
        name, owner = self.s.naming.param_names.get(p, ("<param>", ""))
        g = p.grad
        self.cur.grad_params[id(p)] = p
        if self.cur.scaled_backward:
            self.cur.scaled_grad_params.add(id(p))
        if not self.s._full or not _stats.summarizable(g):
            return
        comm = getattr(self.s, "comm", None)
        # a sharded FSDP2 parameter's gradient is the reduce-scatter's output
        reduced = comm is not None and comm.fsdp_reduction(p, f"{name}.grad")
        # a tensor-parallel gradient is a shard too (reduced across ranks), of the backward
        sharded = reduced or is_sharded(g)
        self.rec.queue(g, _Meta(
            step=self.s._step, order=self.cur.next_order(),
            phase="communication" if reduced else "backward", module=owner,
            tensor=f"{name}.grad", role="param_grad", dtype=str(g.dtype).removeprefix("torch."),
            shape=tuple(g.shape), owner=owner, sharded=sharded,
        ))
