"""nanhunt: find where, why and how to fix NaN/Inf in mixed-precision PyTorch training.

>>> import nanhunt
>>> with nanhunt.watch(model, optimizer, scaler) as hunt:   # doctest: +SKIP
...     train_one_step()
>>> hunt.first_failure                                       # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nanhunt._version import __version__
from nanhunt.errors import NanhuntError
from nanhunt.formats import FORMATS, get_format

if TYPE_CHECKING:
    from nanhunt.capture import Hunt, StopRun, watch
    from nanhunt.pipeline import Sentinel, sentinel
    from nanhunt.precision import audit

__all__ = [
    "FORMATS",
    "Hunt",
    "NanhuntError",
    "Sentinel",
    "StopRun",
    "__version__",
    "audit",
    "get_format",
    "sentinel",
    "watch",
]

# Hunt, watch, the sentinel and audit need torch; importing them on first use keeps
# `nanhunt --help`, usage errors and `nanhunt report` (all torch-free) from paying torch's import
# time (about a second).
_LAZY = {**dict.fromkeys(("Hunt", "StopRun", "watch"), "capture"),
         **dict.fromkeys(("Sentinel", "sentinel"), "pipeline"),
         "audit": "precision"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nanhunt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
