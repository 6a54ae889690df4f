"""nanhunt: find where, why and how to fix NaN/Inf in mixed-precision PyTorch training."""

from __future__ import annotations

from ._version import __version__
from .errors import NanhuntError

__all__ = ["NanhuntError", "__version__"]
