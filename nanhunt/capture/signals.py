"""Signals: what each applied optimizer step did to each param group, and the attention logits
softmax saw, measured every step for almost nothing (fused kernels, device scalars that cross
with the step's one transfer; nothing waits for the device).

Per param group (:class:`~nanhunt.trace.GroupSignal`), from up to SAMPLE evenly strided elements
of each parameter, its gradient and its optimizer state (exact for smaller tensors, an estimate
otherwise; a copy of the sample, not of the weights): the weights' and the gradients' norms,
the norm of what the update changed,
the fraction of elements it left exactly as they were (updates below half a unit in the last
place of a low-precision weight round away), and the second-moment estimate's max and mean
(Adam's ``exp_avg_sq``, RMSprop's ``square_avg``).

With full tracing, a softmax called inside a module's forward also records its input's largest
finite magnitude for that module (attention scores before softmax).
"""

from __future__ import annotations

__all__ = ["SignalObserver"]

from typing import Any

import torch
import torch.nn.functional as F
from torch.optim import optimizer as _O

from nanhunt import stats as _stats
from nanhunt._patching import patch
from nanhunt.capture._util import _safe, _skip
from nanhunt.capture.state import Part
from nanhunt.trace import ParamGroupInfo

#: elements of each parameter (its gradient, its second-moment state) the signals read: evenly
#: strided, so a step costs copies of at most this many per tensor, not passes over the weights
SAMPLE = 4096

#: the optimizer state holding a second-moment estimate, by the name optimizers give it
_MOMENT2 = ("exp_avg_sq", "square_avg", "sum")


class SignalObserver(Part):
    """Global optimizer step pre/post hooks measuring each param group (see the module
    docstring); with ``softmax`` (full tracing), the softmax inputs inside modules too."""

    def __init__(self, session: Any, *, softmax: bool = False) -> None:
        super().__init__(session)
        self.softmax = softmax
        # id(optimizer) -> (step, [(group name, params, their copy before the step)])
        self._before: dict[int, tuple[int, list[Any]]] = {}
        self._names: dict[tuple[int, int], str] = {}  # (id(optimizer), group index) -> name
        self._prefixes: dict[int, str] = {}
        self._counts: dict[str, int] = {}
        self.groups: dict[str, ParamGroupInfo] = {}
        self._in_softmax = False
        # each sampled layout's element weights, made once (the same tensors every step); held
        # by this observer, so they go with it
        self._weights: dict[tuple, torch.Tensor] = {}

    def install(self, stack: Any) -> None:
        stack.enter_context(_O.register_optimizer_step_pre_hook(self._on_pre))
        stack.enter_context(_O.register_optimizer_step_post_hook(self._on_post))
        if self.softmax:
            self._patch(stack, torch.Tensor, "softmax")
            self._patch(stack, torch, "softmax")
            self._patch(stack, F, "softmax")

    # -- param groups ------------------------------------------------------------------------

    def _group_name(self, optimizer: Any, index: int, params: list[torch.Tensor]) -> str:
        name = self._names.get((id(optimizer), index))
        if name is not None:
            return name
        kind = type(optimizer).__name__
        prefix = self._prefixes.get(id(optimizer))
        if prefix is None:  # the second Adam of a GAN is "Adam#2"
            n = self._counts[kind] = self._counts.get(kind, 0) + 1
            prefix = self._prefixes[id(optimizer)] = kind if n == 1 else f"{kind}#{n}"
        name = self._names[(id(optimizer), index)] = f"{prefix}[{index}]"
        owners: list[str] = []
        for p in params:
            owner = self.s.naming.param_names.get(p, ("", ""))[1]
            if owner not in owners:
                owners.append(owner)
        self.groups[name] = ParamGroupInfo(
            name=name, optimizer=kind, index=index, tensors=len(params),
            elements=sum(p.numel() for p in params),
            dtypes=sorted({str(p.dtype).removeprefix("torch.") for p in params}),
            modules=[o or "<root>" for o in owners])
        return name

    @staticmethod
    def _params(group: dict) -> list[torch.Tensor]:
        return [p for p in group["params"] if p.grad is not None and p.is_floating_point()
                and not p.is_sparse and not p.grad.is_sparse and p.numel() > 0]

    # -- the optimizer step ------------------------------------------------------------------

    @_safe
    def _on_pre(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        if not self.s._active or _skip():
            return None
        closure = kwargs.get("closure") if callable(kwargs.get("closure")) else \
            args[1] if len(args) > 1 and callable(args[1]) else None
        if closure is None:
            self._measure_before(optimizer)
            return None
        # the closure (Lightning's training step, LBFGS's re-evaluation) makes this step's
        # gradients: measured after its first call, before the update; it returns exactly
        # what the closure returns
        measured = [False]

        def then_measure(*a: Any, **k: Any) -> Any:
            out = closure(*a, **k)
            if not measured[0]:
                measured[0] = True
                self._guard(self._measure_before, optimizer)
            return out

        if callable(kwargs.get("closure")):
            return args, {**kwargs, "closure": then_measure}
        return (args[0], then_measure, *args[2:]), kwargs

    @torch.no_grad()
    def _measure_before(self, optimizer: Any) -> None:
        kept, step = [], self.s._step
        for i, group in enumerate(optimizer.param_groups):
            params = self._params(group)
            if not params:
                continue
            name = self._group_name(optimizer, i, params)
            if _one_device(params):
                g, weight = _sample(self._weights, [p.grad for p in params])
                self._queue(step, (g.double().pow(2) * weight).sum(), name, "grad_norm")
            copy = _sample(self._weights, params) if _one_device(params) else None
            kept.append((name, params, copy))
            lr = group.get("lr")
            if isinstance(lr, (int, float)) and not isinstance(lr, bool):
                self.rec.signal_value(step, name, "lr", float(lr))
        self._before[id(optimizer)] = (step, kept)

    @_safe
    @torch.no_grad()
    def _on_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        step, kept = self._before.pop(id(optimizer), (0, None))
        if not kept or not self.s._active or _skip():
            return
        for name, params, copy in kept:
            if copy is not None:
                before, weight = copy
                after = _sample(self._weights, params)[0]  # the same elements, after it
                self._queue(step, (after.double().pow(2) * weight).sum(), name, "weight_norm")
                self._queue(step, (before.double().pow(2) * weight).sum(), name,
                            "weight_norm_before")
                delta = after - before
                total = sum(_stats.local(p).numel() for p in params)
                self._queue(step, (delta.double().pow(2) * weight).sum(), name, "update_norm")
                self._queue(step, 1.0 - ((delta != 0) * weight).sum() / total, name,
                            "unchanged", sqrt=False)
            moments = [v for v in (_moment2(optimizer.state.get(p)) for p in params)
                       if v is not None]
            if moments and _one_device(moments):
                v, weight = _sample(self._weights, moments)
                self._queue(step, v.max(), name, "moment2_max", sqrt=False)
                self._queue(step, (v.double() * weight).sum() / weight.sum(), name,
                            "moment2_mean", sqrt=False)

    def _queue(self, step: int, value: torch.Tensor, group: str, key: str, *,
               sqrt: bool = True) -> None:
        """A device scalar of ``step``'s signals; ``sqrt``: a sum of squares (the root is taken on
        the host)."""
        self.rec.scalar(value, f"sig\0{group}\0{key}\0{'sqrt' if sqrt else ''}", step=step)

    # -- softmax inputs ----------------------------------------------------------------------

    def _patch(self, stack: Any, owner: Any, name: str) -> None:
        obs = self

        def wrap(original: Any) -> Any:
            def softmax(*args: Any, **kwargs: Any) -> Any:
                if not obs._in_softmax and obs.s._active and obs.s._full and obs.cur.frames:
                    obs._in_softmax = True  # F.softmax calls Tensor.softmax: measure once
                    try:
                        obs._guard(obs._softmax_input,
                                   args[0] if args else kwargs.get("input"))
                        return original(*args, **kwargs)
                    finally:
                        obs._in_softmax = False
                return original(*args, **kwargs)

            softmax.__wrapped__ = original  # type: ignore[attr-defined]
            return softmax

        if name in vars(owner):
            patch(stack, owner, name, wrap)
        else:  # inherited (Tensor.softmax is _TensorBase's): shadow it, then remove the shadow
            setattr(owner, name, wrap(getattr(owner, name)))
            stack.callback(delattr, owner, name)

    @torch.no_grad()
    def _softmax_input(self, x: Any) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0 \
                or _skip():
            return
        x = x.detach()
        # finite values only: a -inf mask is no logit
        amax = torch.where(torch.isfinite(x), x.abs(), 0).amax()
        self.rec.scalar(amax, f"smax\0{self.cur.frames[-1].name}")


def _sample(cache: dict[tuple, torch.Tensor], tensors: list[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to SAMPLE evenly strided elements of each tensor, as one float32 vector (a copy), and
    each element's weight (how many elements of its tensor it stands for): weighted sums over
    the sample estimate sums over the tensors without copying them (exact for tensors of SAMPLE
    elements or fewer). A DTensor contributes its local shard: the signals of a sharded group
    are this rank's. The weights are made once per layout and kept in ``cache`` (building them
    each step cost more than the sums they weight); callers never change them in place."""
    parts, weights = [], []
    for t in tensors:
        flat = _stats.local(t).detach().reshape(-1)  # a DTensor's local shard (FSDP2)
        stride = -(-flat.numel() // SAMPLE)
        part = flat[::stride]
        parts.append(part)
        weights.append(flat.numel() / part.numel())
    sample = torch.cat(parts).float()
    key = (tuple(weights), tuple(q.numel() for q in parts), sample.device)
    weight = cache.get(key)
    if weight is None:
        weight = cache[key] = torch.repeat_interleave(
            torch.tensor(weights, dtype=torch.float64, device=sample.device),
            torch.tensor(key[1], device=sample.device))
    return sample, weight


def _moment2(state: Any) -> torch.Tensor | None:
    if not isinstance(state, dict):
        return None
    for key in _MOMENT2:
        v = state.get(key)
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 0 \
                and not v.is_sparse:
            return v
    return None


def _one_device(tensors: list[torch.Tensor]) -> bool:
    return len({t.device for t in tensors}) == 1

