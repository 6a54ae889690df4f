"""The Python state of the user's modules, kept out of the audit's replays.

A replay runs the user's ``forward`` again: a module that counts its calls (``self.calls +=
1``), caches a tensor (``self.last = x``), appends to a list or updates a plain tensor
attribute in place would carry the replays' effects into the user's next step. Parameters and
buffers are already the replays' own (``functional_call`` with copies); the rest of each
module's ``__dict__`` is handled here: while the replays run, every tensor attribute is a clone
and every list, dict, set or bytearray a shallow copy, and afterwards each attribute is
rebound to the user's object and attributes the replays added are removed.

A faithful replay also has to *start* where the user's call started: by the time the step is
measured (at ``backward()``) the user's forward has already counted its call and updated its
buffers. :class:`ModuleState` is captured when a top-level call begins (and, in a target
replay, when each module call begins, for the module's float32 replay alone) and installed,
as fresh copies, before each replay of that call.

Not covered (documented in docs/cli.md): objects inside those containers changed in place,
attributes of other objects (a custom ``Stats()`` instance), global variables, forward hooks'
own side effects, and tensor attributes over :data:`COPY_LIMIT_BYTES` (shared, not copied).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["ModuleState", "module_state_kept", "rebind"]

# what every nn.Module keeps in its __dict__ (parameters, buffers, children, hook tables):
# functional_call and the hooks manage those; ``training`` is kept below like user state
_MODULE_KEYS = frozenset(vars(nn.Module())) - {"training"}
_CONTAINERS = (list, dict, set, bytearray)


#: tensor attributes larger than this are shared with the replays, not copied (a module that
#: holds a whole dataset as an attribute would otherwise be copied at every replayed call)
COPY_LIMIT_BYTES = 64 * 2**20


def _stand_in(value: Any) -> Any:
    """What the replays see instead of ``value`` (``value`` itself when rebinding is enough)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        if value.numel() * value.element_size() > COPY_LIMIT_BYTES:
            return value
        try:
            return value.detach().clone() if not value.requires_grad else value.clone()
        except Exception:  # a tensor subclass that cannot be cloned: rebinding only
            return value
    if isinstance(value, _CONTAINERS):
        try:
            return copy.copy(value)
        except Exception:  # a container subclass that cannot be copied: rebinding only
            return value
    return value


@dataclass
class ModuleState:
    """The Python attributes and buffers of a module tree at one moment (copies), so that a
    replay can start from where the user's own call started."""

    mods: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # names relative to root

    @classmethod
    def capture(cls, root: nn.Module) -> ModuleState:
        state = cls()
        seen: set[int] = set()
        for qual, mod in root.named_modules(remove_duplicate=False):
            for bname, buf in mod._buffers.items():
                if buf is not None:
                    state.buffers[f"{qual}.{bname}" if qual else bname] = buf.detach().clone()
            if id(mod) not in seen:
                seen.add(id(mod))
                d = vars(mod)
                state.mods.append((d, {k: _stand_in(v) for k, v in _attrs(d).items()}))
        return state

    def apply(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Install fresh copies of the captured attributes (a replay changes only those);
        returns what was there, for :func:`rebind`."""
        before = []
        for d, attrs in self.mods:
            before.append((d, _attrs(d)))
            _set(d, {k: _stand_in(v) for k, v in attrs.items()})
        return before


def _attrs(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in _MODULE_KEYS}


def _set(d: dict[str, Any], attrs: dict[str, Any]) -> None:
    for k in [k for k in d if k not in _MODULE_KEYS and k not in attrs]:
        del d[k]
    d.update(attrs)


def rebind(before: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """Put back the objects :meth:`ModuleState.apply` replaced (the same objects)."""
    for d, attrs in before:
        _set(d, attrs)


@contextlib.contextmanager
def module_state_kept(roots: Iterable[nn.Module]) -> Iterator[None]:
    """Run the block with stand-ins for the Python state of every module under ``roots``,
    then put the user's state back exactly (the same objects, the same values)."""
    before: list[tuple[dict[str, Any], dict[str, Any]]] = []
    seen: set[int] = set()
    for root in roots:
        for mod in root.modules():
            if id(mod) not in seen:
                seen.add(id(mod))
                d = vars(mod)
                attrs = _attrs(d)
                before.append((d, attrs))
                _set(d, {k: _stand_in(v) for k, v in attrs.items()})
    try:
        yield
    finally:
        rebind(before)
