"""``torchvision.transforms.v2``: only what transformers imports at import time."""

from . import functional
from .. import InterpolationMode

__all__ = ["InterpolationMode", "functional"]
