"""The fixes for failures without a NaN, installed from outside the script (issue 23): a z-loss
on the output logits, a soft cap on the attention logits, a linear learning-rate warm-up.
:class:`nanhunt.experiment.fixes.Fixes` drives them; each makes the change its snippet
(:func:`nanhunt.fixspec.snippet`) makes in the code.

``zloss:PATTERN=COEF``
    the outputs of the modules PATTERN names (the logits) are kept from the forward; the
    script's next ``F.cross_entropy`` or ``F.nll_loss`` (``nn.CrossEntropyLoss`` calls the
    former) returns its loss plus COEF x mean(logsumexp(logits.float(), -1)^2): the script's
    own loss, the one it prints and backpropagates, is what changes.
``cap:PATTERN=VALUE``
    while one of those modules runs, every softmax it calls (``torch.softmax``, ``F.softmax``,
    ``Tensor.softmax``) gets VALUE x tanh(x / VALUE) of its input; masked entries (-inf, or
    at or below half the dtype's lowest value, as libraries write masks) stay as they were. The
    patch sits on top of nanhunt's own softmax observer, so a report sees the capped logits.
``warmup=N``
    an optimizer step pre-hook multiplies each group's lr by min(1, (k+1)/N) at the optimizer's
    k-th applied step, whatever lr the script or its scheduler set; a post-hook puts the
    script's value back, so its schedule, prints and checkpoints see their own numbers.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from nanhunt._patching import patch

__all__ = ["SoftCap", "Warmup", "ZLoss", "soft_cap"]

#: the softmax entry points a cap patches while its module runs
_SOFTMAX = ((torch, "softmax"), (F, "softmax"), (torch.Tensor, "softmax"))
#: the loss functions a z-loss adds to (softmax cross-entropies)
_LOSSES = ("cross_entropy", "nll_loss")


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``, masked entries (-inf, at or below half the lowest finite value)
    kept as they are."""
    if not x.is_floating_point():
        return x
    masked = x <= torch.finfo(x.dtype).min / 2
    return torch.where(masked, x, cap * torch.tanh(x / cap))


class SoftCap:
    """Softmax inputs capped while one module call runs: entered by the module's pre-hook,
    left by its post-hook (a nested cap leaves the outer one in charge)."""

    active = 0  # caps entered (a softmax inside two capped modules is capped once)

    def __init__(self, cap: float, counter: list[int]) -> None:
        self.cap = cap
        self.counter = counter  # softmax calls capped, for the fix's owner
        self._stack: contextlib.ExitStack | None = None
        self._inside = False

    def __enter__(self) -> SoftCap:
        stack = contextlib.ExitStack()
        if SoftCap.active == 0:
            for owner, name in _SOFTMAX:
                _shadow(stack, owner, name, self._wrap)
        SoftCap.active += 1
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> bool:
        SoftCap.active -= 1
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        return False

    def _wrap(self, original: Any) -> Any:
        cap = self

        def softmax(*args: Any, **kwargs: Any) -> Any:
            if cap._inside:  # F.softmax calls Tensor.softmax: cap once
                return original(*args, **kwargs)
            cap._inside = True
            try:
                if args and isinstance(args[0], torch.Tensor):
                    args = (soft_cap(args[0], cap.cap), *args[1:])
                    cap.counter[0] += 1
                elif isinstance(kwargs.get("input"), torch.Tensor):
                    kwargs["input"] = soft_cap(kwargs["input"], cap.cap)
                    cap.counter[0] += 1
                return original(*args, **kwargs)
            finally:
                cap._inside = False

        softmax.__wrapped__ = original  # type: ignore[attr-defined]
        return softmax


def _shadow(stack: contextlib.ExitStack, owner: Any, name: str, wrapper: Any) -> None:
    if name in vars(owner):
        patch(stack, owner, name, wrapper)
    else:  # inherited (Tensor.softmax is TensorBase's): shadow it, then remove the shadow
        setattr(owner, name, wrapper(getattr(owner, name)))
        stack.callback(delattr, owner, name)


class ZLoss:
    """The logits kept from the named modules' forwards, added as a z-loss to the next loss."""

    def __init__(self, mismatch: type[BaseException]) -> None:
        self.mismatch = mismatch  # what a loss this fix cannot apply to raises (FixMismatch)
        self.pending: list[tuple[torch.Tensor, float]] = []
        self.added = 0  # losses the term was added to
        self._inside = False

    def install(self, stack: contextlib.ExitStack) -> None:
        for name in _LOSSES:
            patch(stack, F, name, self._wrap)
        stack.callback(self.pending.clear)

    def keep(self, output: Any, coef: float) -> None:
        """A named module's output: the logits of this step's z-loss (only in a forward that
        autograd records: an evaluation under no_grad is left alone)."""
        if isinstance(output, torch.Tensor) and output.is_floating_point() and \
                output.requires_grad and torch.is_grad_enabled():
            self.pending.append((output, coef))

    def term(self) -> torch.Tensor | None:
        if not self.pending:
            return None
        total = None
        for logits, coef in self.pending:
            z = coef * logits.float().logsumexp(-1).pow(2).mean()
            total = z if total is None else total + z
        self.pending.clear()
        return total

    def _wrap(self, original: Any) -> Any:
        zl = self

        def loss_fn(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if zl._inside or not zl.pending or not isinstance(out, torch.Tensor):
                return out
            if out.dim() != 0:
                raise zl.mismatch("--fix zloss: the loss is not reduced to one number "
                                  "(reduction='none'): add the z term where the script "
                                  "reduces it (see the snippet)")
            zl._inside = True
            try:
                z = zl.term()
                zl.added += 1
                return out + z
            finally:
                zl._inside = False

        loss_fn.__wrapped__ = original  # type: ignore[attr-defined]
        return loss_fn


class Warmup:
    """A linear warm-up over each optimizer's applied steps, on top of the script's lr."""

    def __init__(self, steps: int) -> None:
        self.steps = max(1, int(steps))
        self._done: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._saved: list[tuple[dict, Any]] = []

    def factor(self, optimizer: Any) -> float:
        return min(1.0, (self._done.get(optimizer, 0) + 1) / self.steps)

    def before(self, optimizer: Any) -> None:
        f = self.factor(optimizer)
        self._saved = [(g, g["lr"]) for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * f

    def after(self, optimizer: Any) -> None:
        for g, lr in self._saved:
            g["lr"] = lr
        self._saved = []
        self._done[optimizer] = self._done.get(optimizer, 0) + 1
