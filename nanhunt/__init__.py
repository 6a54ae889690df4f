"""nanhunt: find where, why and how to fix NaN/Inf in mixed-precision PyTorch training.

>>> import nanhunt
>>> with nanhunt.watch(model, optimizer, scaler) as hunt:   # doctest: +SKIP
...     train_one_step()
>>> hunt.first_failure                                       # doctest: +SKIP
"""

from __future__ import annotations

from ._version import __version__
from .capture import Hunt, watch
from .errors import NanhuntError
from .formats import FORMATS, get_format
from .precision import audit

__all__ = ["FORMATS", "Hunt", "NanhuntError", "__version__", "audit", "get_format", "watch"]
