"""The functional forms the corpus's libraries import at import time (transformers'
``image_utils`` imports ``pil_to_tensor`` when it finds a torchvision)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

__all__ = ["pil_to_tensor"]


def pil_to_tensor(pic) -> torch.Tensor:
    """A PIL image to a CxHxW tensor of its own dtype (no scaling), as torchvision's."""
    if not isinstance(pic, Image.Image):
        raise TypeError(f"pic should be a PIL image, got {type(pic)}")
    arr = np.array(pic, copy=True)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.dtype == np.bool_:
        arr = arr.astype(np.uint8)
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()
