"""The one way nanhunt replaces an attribute of torch or of a library: the exact object that was
there goes back when the stack closes (a staticmethod stays a staticmethod, a module function
stays the same function object)."""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["patch"]


def patch(stack: contextlib.ExitStack, owner: Any, name: str, wrapper: Any) -> None:
    """Replace ``owner.name`` (a class's or a module's own attribute) by ``wrapper(original)``;
    closing ``stack`` puts the original back."""
    original = vars(owner)[name]
    setattr(owner, name, wrapper(original))
    stack.callback(setattr, owner, name, original)
