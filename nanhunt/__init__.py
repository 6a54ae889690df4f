"""nanhunt: find where, why and how to fix NaN/Inf in mixed-precision PyTorch training.

>>> import nanhunt
>>> with nanhunt.watch(model, optimizer, scaler) as hunt:   # doctest: +SKIP
...     train_one_step()
>>> hunt.first_failure                                       # doctest: +SKIP
"""

from __future__ import annotations

from ._version import __version__
from .capture import Hunt, Sentinel, StopRun, sentinel, watch
from .errors import NanhuntError
from .formats import FORMATS, get_format

__all__ = [
    "FORMATS",
    "Hunt",
    "NanhuntError",
    "Sentinel",
    "StopRun",
    "__version__",
    "get_format",
    "sentinel",
    "watch",
]
