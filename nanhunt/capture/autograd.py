"""Autograd observer: hooks on recorded outputs' gradients, and post-accumulate hooks on the
parameters (their ``.grad`` once backward has summed it)."""

from __future__ import annotations

from typing import Any

import torch

from .. import stats as _stats
from ._util import _safe, _skip
from .state import Part, _Meta


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

    def _grad_meta(self, idx: int, grad: torch.Tensor, step: int) -> _Meta:
        src = self.rec.metas[idx]
        if src.consumers:
            blamed = self.cur.calls[src.consumers[-1]].name
            tensor = "grad_" + src.consumer_paths[-1]
        elif src.parent is not None:
            blamed = self.cur.calls[src.parent].name
            tensor = f"grad of {src.owner}.{src.tensor}"
        else:
            blamed, tensor = "", f"grad of {src.owner}.{src.tensor}"
        return _Meta(
            step=step, order=self.cur.next_order(), phase="backward", module=blamed,
            tensor=tensor,
            role="grad_input" if src.consumers else "grad_output",
            dtype=str(grad.dtype).removeprefix("torch."), shape=tuple(grad.shape),
            owner=src.owner if src.role == "output" else "", producer=None, parent=None,
            also_owners=list(src.also_owners),
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
        self.rec.queue(g, _Meta(
            step=self.s._step, order=self.cur.next_order(), phase="backward", module=owner,
            tensor=f"{name}.grad", role="param_grad", dtype=str(g.dtype).removeprefix("torch."),
            shape=tuple(g.shape), owner=owner,
        ))
