"""``torchvision.transforms.v2``: only what transformers imports at import time."""

from .. import InterpolationMode
from . import functional

__all__ = ["InterpolationMode", "functional"]
