"""``torchvision.transforms.v2.functional``: transformers imports it (as ``tvF``) at import
time; the stand-in has the same ``pil_to_tensor`` as ``transforms.functional``."""

from ..functional import pil_to_tensor

__all__ = ["pil_to_tensor"]
