"""The one replay contract: a replay never changes anything the user can observe afterwards.

Every replay nanhunt runs (a culprit module on its captured inputs, a kept training step, an
optimizer step, an audited forward in another precision) goes through this module:

- **Copies, declared and capped.** What a replay runs on is a copy (:class:`Copies`): modules,
  captured inputs, optimizer and GradScaler state. Each copy is declared with its size in
  bytes before it is made; a replay whose copies would exceed :func:`max_copy_bytes`
  (``NANHUNT_REPLAY_MAX_BYTES``, default 4 GiB) is refused with :class:`CopyRefused`, whose
  message says what it would have copied, instead of deep-copying a 10 GB model silently.
  The audit's tape is the one replay that runs the user's own modules: it passes copies of
  their parameters and buffers to ``torch.func.functional_call`` and stand-ins for their
  Python attributes (:class:`ModuleState`).
- **The ambient state, saved and put back** (:func:`isolated`): every random generator
  (torch's CPU generator, each initialised CUDA device's, Python's ``random`` and numpy's
  global one), grad mode, inference mode and each device type's autocast state (enabled,
  dtype, cache). Inside, the replay starts from a neutral state (grad enabled, autocast off,
  not in inference mode), whatever the user's code was doing when the replay began, and sets
  per call what the captured call had.
- **Never inside the user's step.** Replays run after the user's step returned (the sentinel
  records a failing step in its hooks and analyses it at the next step boundary or at exit),
  or after the run.

Not covered: global variables and objects outside the modules replayed (a counter in another
module, a file the forward writes), and a dispatch or function mode the user's code has
entered around the step (the replay's ops would pass through it).
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nanhunt.errors import NanhuntError

__all__ = [
    "Copies",
    "CopyRefused",
    "cuda_devices",
    "is_fsdp1",
    "isolated",
    "max_copy_bytes",
    "nbytes",
    "rng_kept",
    "rng_state",
    "set_rng_state",
    "sharded_how",
]

#: the default cap on what one replay copies (bytes); ``NANHUNT_REPLAY_MAX_BYTES`` overrides it
DEFAULT_MAX_COPY_BYTES = 4 * 2**30

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "hpu", "mps")


def is_fsdp1(module: Any) -> bool:
    """An FSDP1 wrapper (``FullyShardedDataParallel``; FSDP2's ``fully_shard`` keeps the
    module's own class)."""
    return type(module).__name__ == "FullyShardedDataParallel" and \
        isinstance(getattr(module, "_fsdp_wrapped_module", None), torch.nn.Module)


def sharded_how(module: Any) -> str:
    """How ``module``'s weights are split across ranks (FSDP1, FSDP2, tensor parallelism's
    DTensors), or "" when every rank holds them whole: one rank cannot copy or replay such a
    module alone (its forward gathers the weights with collectives its peers are not in)."""
    if any(is_fsdp1(m) for m in module.modules()):
        return "sharded by FSDP (FullyShardedDataParallel)"
    if any(type(p).__name__ == "DTensor" for p in module.parameters()):
        return "sharded by FSDP2 or tensor parallelism (DTensor parameters)"
    return ""


class CopyRefused(NanhuntError):
    """A replay would copy more than the cap allows; the message says what and how much."""


def max_copy_bytes() -> int:
    """The cap on the bytes one replay may copy (``NANHUNT_REPLAY_MAX_BYTES``)."""
    raw = os.environ.get("NANHUNT_REPLAY_MAX_BYTES", "")
    try:
        return int(float(raw)) if raw.strip() else DEFAULT_MAX_COPY_BYTES
    except ValueError:
        return DEFAULT_MAX_COPY_BYTES


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _tensors_of(obj: Any, out: list[torch.Tensor], seen: set[int], depth: int = 0) -> None:
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, nn.Module):
        out.extend(obj.parameters())
        out.extend(obj.buffers())
        for m in obj.modules():  # tensors kept as plain attributes (a cache) are copied too
            for k, v in vars(m).items():
                if k not in ("_parameters", "_buffers", "_modules") and isinstance(
                        v, (torch.Tensor, dict, list, tuple)):
                    _tensors_of(v, out, seen, depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors_of(v, out, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            _tensors_of(v, out, seen, depth + 1)
    elif hasattr(obj, "state_dict") and hasattr(obj, "param_groups"):  # an optimizer
        _tensors_of(getattr(obj, "state", {}), out, seen, depth + 1)


def nbytes(*objs: Any) -> int:
    """Bytes of the tensors in ``objs`` (modules, optimizers, tensor trees), shared storage
    counted once: what a deep copy of them allocates."""
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    for obj in objs:
        _tensors_of(obj, tensors, seen)
    storages: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t.layout != torch.strided or t.device.type == "meta":
            storages[("", id(t))] = t.numel() * t.element_size()
            continue
        try:
            st = t.untyped_storage()
            storages[(str(t.device), st.data_ptr())] = st.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            storages[("", id(t))] = t.numel() * t.element_size()
    return sum(storages.values())


@dataclass
class Copies:
    """What one replay copies: each copy declared (label, bytes) before it is made, refused
    above ``cap``. ``describe()`` is the line a report or an error shows."""

    cap: int = field(default_factory=max_copy_bytes)
    items: list[tuple[str, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(n for _, n in self.items)

    def declare(self, label: str, size: int) -> None:
        """Account for a copy of ``size`` bytes; :class:`CopyRefused` when it would exceed
        the cap (nothing is copied then)."""
        if self.total + size > self.cap:
            held = f" (on top of {self.describe()})" if self.items else ""
            raise CopyRefused(
                f"replaying would copy {label} ({_size(size)}){held}, more than the cap of "
                f"{_size(self.cap)}; not replayed (raise it with NANHUNT_REPLAY_MAX_BYTES)")
        self.items.append((label, size))

    def describe(self) -> str:
        parts = ", ".join(f"{label} {_size(n)}" for label, n in self.items)
        return f"{parts or 'nothing'} ({_size(self.total)} in all)"

    def module(self, module: nn.Module, label: str, memo: dict | None = None) -> Any:
        """A deep copy of ``module`` (its parameters, buffers and Python attributes)."""
        self.declare(label, nbytes(module))
        return copy.deepcopy(module, memo if memo is not None else {})

    def tree(self, obj: Any, label: str) -> Any:
        """A deep copy of a tree of tensors and plain values (captured inputs)."""
        self.declare(label, nbytes(obj))
        return copy.deepcopy(obj)

    def optimizer(self, optimizer: Any, params: dict[int, torch.Tensor] | None = None,
                  label: str = "optimizer state") -> Any:
        """A copy of ``optimizer`` stepping ``params`` ({id(user param): its copy}; None: a
        deep copy with its own parameters). Its state is a deep copy: the user's is never
        stepped."""
        if params is None:  # its parameters and their gradients are copied too
            own = [p for g in optimizer.param_groups for p in g["params"]]
            grads = [p.grad for p in own if p.grad is not None]
            self.declare(label, nbytes(optimizer, own, grads))
            return copy.deepcopy(optimizer)
        self.declare(label, nbytes(optimizer))
        memo: dict[int, Any] = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in params:
                    raise CopyRefused("the optimizer also steps parameters outside the "
                                      "replayed modules")
                memo[id(p)] = params[id(p)]
        return copy.deepcopy(optimizer, memo)

    def scaler(self, scaler: Any, scale: float | None = None) -> Any:
        """A GradScaler copy with fresh per-optimizer state and its own scale and growth
        tracker (``scale`` replaces the scale it starts from)."""
        from collections import defaultdict

        from torch.amp.grad_scaler import _refresh_per_optimizer_state

        dup = copy.copy(scaler)
        dup._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        if getattr(scaler, "_scale", None) is not None:
            value = scale if scale is not None else float(scaler._scale)
            dup._scale = torch.full_like(scaler._scale, value)
            dup._growth_tracker = scaler._growth_tracker.clone()
        return dup


# ----------------------------------------------------------------------------- the RNGs


def cuda_devices() -> list[int]:
    """CUDA devices whose generators exist now (asked each time: a script initialises CUDA
    after nanhunt starts)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    return list(range(torch.cuda.device_count()))


def _numpy_random() -> Any:
    # only when the script imported numpy itself: a replay never imports it for the user
    np = sys.modules.get("numpy")
    return getattr(np, "random", None) if np is not None else None


def rng_state() -> tuple[Any, ...]:
    """Every generator a forward may draw from: torch's CPU and CUDA generators, and Python's
    and numpy's global ones (stochastic depth written with ``random.random()``)."""
    np_random = _numpy_random()
    return (torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in cuda_devices()},
            random.getstate(), np_random.get_state() if np_random is not None else None)


def set_rng_state(state: tuple[Any, ...]) -> None:
    cpu, cuda, py, np_state = state
    torch.set_rng_state(cpu)
    for d, s in cuda.items():
        torch.cuda.set_rng_state(s, d)
    random.setstate(py)
    np_random = _numpy_random()
    if np_state is not None and np_random is not None:
        np_random.set_state(np_state)


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """The user's generators as they were when the block began (``torch.random.fork_rng``
    covers torch's only)."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


# ----------------------------------------------------------------------------- ambient state


def _autocast_devices() -> list[str]:
    out = ["cpu"]
    for dev in _AUTOCAST_DEVICES[1:]:
        mod = getattr(torch, dev, None)
        try:
            if mod is not None and mod.is_available():
                out.append(dev)
        except Exception:  # a backend that cannot answer: not used by this process
            continue
    return out


def _autocast_states() -> dict[str, tuple[bool, torch.dtype]]:
    return {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
            for d in _autocast_devices()}


@contextlib.contextmanager
def isolated(*, neutral: bool = True) -> Iterator[None]:
    """Run a replay: every generator, grad mode, inference mode and autocast state (and its
    cache flag) are put back afterwards, also when the replay raises. ``neutral``: inside, the
    replay starts from grad enabled, autocast off and outside inference mode (False: from the
    caller's state, for a replay that sets each call's own, as the audit's tape does)."""
    rng = rng_state()
    grad = torch.is_grad_enabled()
    autocast = _autocast_states()
    cache = torch.is_autocast_cache_enabled()
    try:
        with contextlib.ExitStack() as stack:
            if not neutral:
                yield
                return
            if torch.is_inference_mode_enabled():
                stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            for dev in autocast:
                stack.enter_context(torch.autocast(dev, enabled=False))
            yield
    finally:
        set_rng_state(rng)
        torch.set_grad_enabled(grad)
        for dev, (enabled, dtype) in autocast.items():
            torch.set_autocast_enabled(dev, enabled)
            torch.set_autocast_dtype(dev, dtype)
        torch.set_autocast_cache_enabled(cache)
