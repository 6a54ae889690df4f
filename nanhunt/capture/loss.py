"""Loss observer: ``Tensor.backward`` and ``GradScaler.scale`` wrappers, which see the loss (and
the targets its loss function saved) before backward starts."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from nanhunt import stats as _stats
from nanhunt.capture._util import _in_backward, patch
from nanhunt.capture.state import Part, _Meta


class LossObserver(Part):
    """The step's loss: its value (a device scalar for the timeline) and its row; a backward
    after the optimizer ran starts a new step; a GradScaler-scaled loss is recorded unscaled,
    once, at ``scale()``, and its backward is marked as scaled."""

    def install(self, stack: Any) -> None:
        patch(stack, torch.Tensor, "backward", self._wrap_backward)
        patch(stack, torch.amp.GradScaler, "scale", self._wrap_scale)

    def _record_loss(self, loss: torch.Tensor, role: str) -> None:
        if not _stats.summarizable(loss):
            return
        if self.s._full:
            self._record_loss_targets(loss)
        self.rec.scalar(loss.detach().float().mean() if loss.numel() != 1 else loss, "loss")
        self.rec.queue(loss, _Meta(
            step=self.s._step, order=self.cur.next_order(), phase="forward", module="",
            tensor="loss", role=role, dtype=str(loss.dtype).removeprefix("torch."),
            shape=tuple(loss.shape),
        ))

    def _record_loss_targets(self, loss: torch.Tensor) -> None:
        """Targets handed to a loss function (``F.mse_loss(pred, target)``): no module ever
        sees them, but the loss's autograd node saved them; a NaN there is bad data."""
        node, todo, seen = None, [loss.grad_fn], 0
        while todo and seen < 8:
            node = todo.pop(0)
            if node is None:
                continue
            seen += 1
            if "Loss" in type(node).__name__ or "Entropy" in type(node).__name__:
                target = getattr(node, "_saved_target", None)
                if isinstance(target, torch.Tensor) and _stats.summarizable(target) \
                        and self.cur.lookup(target) is None:
                    op = type(node).__name__.removesuffix("Backward0").removesuffix("Backward")
                    self.on_target(target, op)
            todo.extend(fn for fn, _ in node.next_functions)

    def on_target(self, target: torch.Tensor, op: str) -> None:
        """A loss target found in the loss's graph: one data row (a replay calls this with the
        targets a sentinel kept)."""
        idx = self.rec.queue(target, _Meta(
            step=self.s._step, order=self.cur.next_order(), phase="data", module="",
            tensor=f"target of {op}", role="input",
            dtype=str(target.dtype).removeprefix("torch."), shape=tuple(target.shape)))
        self.cur.remember(target, idx)
        self.cur.targets[idx] = target

    def _wrap_backward(self, original: Any) -> Any:
        obs = self

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            obs._guard(obs._before_backward, tensor)
            result = original(tensor, *args, **kwargs)
            comm = getattr(obs.s, "comm", None)
            if comm is not None:  # the gradients are reduced across ranks by now (DDP)
                comm.after_backward()
            obs._guard(obs._after_backward)
            return result

        backward.__wrapped__ = original  # type: ignore[attr-defined]
        return backward

    def _before_backward(self, tensor: torch.Tensor) -> None:
        if self.s._foreign_thread():
            return
        if self.s._active and not _in_backward() and self.s._closure_step != self.s._step \
                and self.s._optimizer_ran_step == self.s._step:
            self.s._end_step()
        if self.s._active and not _in_backward():
            self.cur.scaled_backward = any(r() is tensor for r in self.cur.scaled_losses)
            if not self.cur.scaled_backward:
                self._record_loss(tensor, "loss")
            if self.s._full:
                self.s.autograd.hook_casts(tensor)
            self.cur.did_backward = True

    def _after_backward(self) -> None:
        """A loop with no torch optimizer updates its weights itself, after the backward (a
        hand-written ``p.data.add_``, which no hook sees): the step's one transfer goes now,
        while the weights are those the step read, so that a failing step is judged and its
        culprit copied on them (at the next forward the script's update has overwritten
        them)."""
        s = self.s
        if not s._active or _in_backward() or s._foreign_thread() or self.cur.transferred:
            return
        if self.cur.did_backward and not (s._saw_optimizer or s._optimizer_exists
                                          or self.cur.step_scaler or s.scaler_seen) \
                and s._closure_step != s._step:
            s._flush()

    def _wrap_scale(self, original: Any) -> Any:
        obs = self

        def scale(scaler: Any, outputs: Any) -> Any:
            result = original(scaler, outputs)
            obs._guard(obs._after_scale, scaler, outputs, result)
            return result

        scale.__wrapped__ = original  # type: ignore[attr-defined]
        return scale

    def _after_scale(self, scaler: Any, outputs: Any, result: Any) -> None:
        if self.s._active and scaler.is_enabled() and not self.s._foreign_thread():
            self.s.scaler_seen = self.cur.step_scaler = True
            if isinstance(outputs, torch.Tensor):
                self._record_loss(outputs, "loss")
                self.cur.scaled_losses.append(weakref.ref(result))
            if scaler._scale is not None:
                self.rec.scalar(scaler._scale, "scale")
            self.s._scaler_ref = weakref.ref(scaler)
