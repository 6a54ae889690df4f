"""DDP communication hooks the script registers (``register_comm_hook``), by name.

A hook such as ``fp16_compress_hook`` reduces the gradients in another format than the one they
were computed in. nanhunt records gradients as they accumulate, before the reduction, and does
not observe the reduction itself: a gradient that only the reduction made non-finite is first
seen in the optimizer's step. The names let the report say so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["comm_hooks_seen"]


@contextlib.contextmanager
def comm_hooks_seen(seen: list[str]) -> Iterator[None]:
    """While installed, each ``DistributedDataParallel.register_comm_hook(state, hook)`` call
    appends the hook's name to ``seen`` (and registers the hook unchanged)."""
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
    except Exception:  # a torch without distributed
        yield
        return
    original = DDP.register_comm_hook

    def register_comm_hook(self: Any, state: Any, hook: Any) -> Any:
        name = getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) \
            or type(hook).__name__
        if name not in seen:
            seen.append(str(name))
        return original(self, state, hook)

    register_comm_hook.__wrapped__ = original  # type: ignore[attr-defined]
    DDP.register_comm_hook = register_comm_hook
    try:
        yield
    finally:
        DDP.register_comm_hook = original
