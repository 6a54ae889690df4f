"""The forward of one step as a tape of top-level calls, replayable in another precision.

While the audit traces a step, every call made at the top level (outside any module) that
touches a tensor computed by the model is kept with its arguments: the model's own call
(``model(x)``), the loss (``F.cross_entropy(out, y)`` or a loss module), ``scaler.scale(loss)``.
Replaying the tape from the loss backwards runs the same step again in float32 or in a target
format, on the same batch, with the same weights and the same random numbers, without touching
the user's parameters, buffers, gradients or RNG (parameters are passed to
``torch.func.functional_call``; buffers are copied; the caller forks the RNG).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map

from nanhunt.contract import (  # the one replay contract's generators
    cuda_devices,
    isolated,
    rng_kept,
    rng_state,
    set_rng_state,
)
from nanhunt.precision._state import rebind

__all__ = ["Entry", "Tape", "autocast_pinned", "cast_floating", "cuda_devices", "rng_kept",
           "rng_state", "set_rng_state"]

# in-place calls that return nothing useful: their first argument is what they produce
_INPLACE_NONE = {"__setitem__"}


def _name(func: Any) -> str:
    return getattr(func, "__name__", "") or str(func)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _autocast_state() -> dict[str, tuple[bool, torch.dtype]]:
    kinds = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return {k: (torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds}


@contextlib.contextmanager
def autocast_as(state: dict[str, tuple[bool, torch.dtype]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for kind, (enabled, dtype) in state.items():
            stack.enter_context(torch.autocast(device_type=kind, dtype=dtype, enabled=enabled))
        yield


@contextlib.contextmanager
def autocast_pinned(dtype: torch.dtype | None) -> Iterator[None]:
    """Autocast as a replay needs it, also inside code that enters autocast itself (a forward
    wrapped in ``torch.autocast``, as accelerate wraps it for transformers' ``--bf16``).

    ``None``: autocast stays off, whatever the code enters (a float32 reference); a dtype:
    every autocast the code enters computes in it (a simulated target). Every enter and exit
    of ``torch.autocast`` goes through ``torch.set_autocast_enabled``/``_dtype``, so the two are
    pinned for the block and put back, the exact objects, after it.
    """
    set_enabled, set_dtype = torch.set_autocast_enabled, torch.set_autocast_dtype

    def enabled(*args: Any) -> None:  # (device, enabled) or the deprecated (enabled)
        set_enabled(*args[:-1], False)

    def dtype_(device: str, _dtype: torch.dtype) -> None:
        set_dtype(device, dtype)

    try:
        if dtype is None:
            torch.set_autocast_enabled = enabled
        else:
            torch.set_autocast_dtype = dtype_
        yield
    finally:
        torch.set_autocast_enabled, torch.set_autocast_dtype = set_enabled, set_dtype


def cast_floating(tree: Any, dtype: torch.dtype | None, *, copy: bool = False) -> Any:
    """Every floating tensor in ``tree`` in ``dtype`` (None keeps it), detached when copied."""

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        if copy:
            return t.detach().to(dtype or t.dtype, copy=True)
        return t if dtype is None else t.to(dtype)

    return tree_map(one, tree)


@dataclass
class Entry:
    """One top-level call: a module (``fn`` is the module) or a torch function."""

    fn: Any
    args: tuple
    kwargs: dict
    out: Any
    module: bool
    autocast: dict[str, tuple[bool, torch.dtype]]
    grad_enabled: bool
    rng: Any = None
    state: Any = None  # a module call's ModuleState when it began (``_state.py``)
    produces: list[int] = field(default_factory=list)  # ids of the tensors it made or changed
    uses: list[int] = field(default_factory=list)  # ids of tracked tensors among its arguments


class Tape:
    """Top-level calls of the current step that touch the model's outputs."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self._tracked: dict[int, torch.Tensor] = {}

    def clear(self) -> None:
        self.entries.clear()
        self._tracked.clear()

    def tracks(self, tree: Any) -> bool:
        return any(id(t) in self._tracked and self._tracked[id(t)] is t for t in _tensors(tree))

    def add(self, entry: Entry) -> None:
        used = _tensors((entry.args, entry.kwargs))
        entry.uses = [id(t) for t in used if self._tracked.get(id(t)) is t]
        made = _tensors(entry.out)
        if not entry.module and _name(entry.fn) in _INPLACE_NONE and entry.args:
            made += _tensors(entry.args[0])
        entry.produces = [id(t) for t in made]
        for t in made:
            self._tracked[id(t)] = t
        self.entries.append(entry)

    def needed(self, tensor: torch.Tensor) -> list[Entry]:
        """The entries ``tensor`` depends on, in execution order (empty: not from the tape)."""
        if self._tracked.get(id(tensor)) is not tensor:
            return []
        want, keep = {id(tensor)}, []
        for e in reversed(self.entries):
            if want.intersection(e.produces):
                keep.append(e)
                want.update(e.uses)
        return keep[::-1]

    def replay(
        self,
        entries: list[Entry],
        *,
        params: Callable[[Entry], dict[str, torch.Tensor]],
        autocast: Callable[[Entry], dict[str, tuple[bool, torch.dtype]]],
        inputs: Callable[[Any], Any],
    ) -> dict[int, Any]:
        """Run ``entries`` again; returns {id(original tensor): its replayed counterpart}.

        ``params(entry)`` gives the parameters and buffers a module call runs with (its
        Python attributes are the copies its ``state`` holds, for the call), ``autocast``
        the autocast state of each call, ``inputs`` maps arguments that did not come from the
        tape (the batch, targets, the scaler's scale).
        """
        with isolated(neutral=False):  # the replay contract: generators and modes put back
            return self._replay(entries, params, autocast, inputs)

    def _replay(self, entries: list[Entry], params: Callable[[Entry], dict[str, torch.Tensor]],
                autocast: Callable[[Entry], dict[str, tuple[bool, torch.dtype]]],
                inputs: Callable[[Any], Any]) -> dict[int, Any]:
        env: dict[int, Any] = {}
        originals: dict[int, torch.Tensor] = {}  # identity, not just id: ids are reused

        def sub(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                if id(t) in env and originals.get(id(t)) is t:
                    return env[id(t)]
                return inputs(t)
            return t

        for e in entries:
            args, kwargs = tree_map(sub, e.args), tree_map(sub, e.kwargs)
            if e.rng is not None:
                set_rng_state(e.rng)
            with autocast_as(autocast(e)), torch.set_grad_enabled(e.grad_enabled):
                if e.module:
                    before = e.state.apply() if e.state is not None else []
                    try:
                        # tie_weights=False: every name gets its own value (a tied weight
                        # has one per module using it, cast for that module's precision)
                        out = functional_call(e.fn, params(e), args, kwargs, strict=False,
                                              tie_weights=False)
                    finally:
                        rebind(before)
                else:
                    out = e.fn(*args, **kwargs)
            made_old = _tensors(e.out)
            made_new = _tensors(out)
            if not e.module and _name(e.fn) in _INPLACE_NONE and e.args:
                made_old += _tensors(e.args[0])
                made_new += _tensors(args[0])
            for old, new in zip(made_old, made_new, strict=False):
                env[id(old)] = new
                originals[id(old)] = old
        return env


def call_entry(fn: Any, args: tuple, kwargs: dict, out: Any, *, module: bool,
               rng: Any = None, state: Any = None) -> Entry:
    return Entry(
        fn=fn,
        args=args,
        kwargs=dict(kwargs),
        out=out,
        module=module,
        autocast=_autocast_state(),
        grad_enabled=torch.is_grad_enabled(),
        rng=rng,
        state=state,
    )
