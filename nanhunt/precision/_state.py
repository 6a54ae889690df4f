"""The Python state of the user's modules, kept out of the audit's replays.

A replay runs the user's ``forward`` again: a module that counts its calls (``self.calls +=
1``), caches a tensor (``self.last = x``), appends to a list or updates a plain tensor
attribute in place would carry the replays' effects into the user's next step. Parameters and
buffers are already the replays' own (``functional_call`` with copies); the rest of each
module's ``__dict__`` is handled here: while the replays run, every tensor attribute is a clone
and every list, dict, set or bytearray a shallow copy, and afterwards each attribute is
rebound to the user's object and attributes the replays added are removed.

Not covered (documented in docs/cli.md): objects inside those containers changed in place,
attributes of other objects (a custom ``Stats()`` instance), global variables and forward
hooks' own side effects.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["module_state_kept"]

# what every nn.Module keeps in its __dict__ (parameters, buffers, children, hook tables):
# functional_call and the hooks manage those; ``training`` is kept below like user state
_MODULE_KEYS = frozenset(vars(nn.Module())) - {"training"}
_CONTAINERS = (list, dict, set, bytearray)


def _stand_in(value: Any) -> Any:
    """What the replays see instead of ``value`` (``value`` itself when rebinding is enough)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        return value.detach().clone() if not value.requires_grad else value.clone()
    if isinstance(value, _CONTAINERS):
        try:
            return copy.copy(value)
        except Exception:  # a container subclass that cannot be copied: rebinding only
            return value
    return value


@contextlib.contextmanager
def module_state_kept(roots: Iterable[nn.Module]) -> Iterator[None]:
    """Run the block with stand-ins for the Python state of every module under ``roots``,
    then put the user's state back exactly (the same objects, the same values)."""
    saved: list[tuple[dict[str, Any], dict[str, Any]]] = []
    seen: set[int] = set()
    for root in roots:
        for mod in root.modules():
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            d = vars(mod)
            attrs = {k: v for k, v in d.items() if k not in _MODULE_KEYS}
            saved.append((d, attrs))
            for k, v in attrs.items():
                d[k] = _stand_in(v)
    try:
        yield
    finally:
        for d, attrs in saved:
            for k in [k for k in d if k not in _MODULE_KEYS and k not in attrs]:
                del d[k]
            d.update(attrs)
