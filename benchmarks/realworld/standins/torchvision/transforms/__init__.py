"""The transforms the corpus's vision scripts use, on PIL images and CxHxW tensors.

Each follows torchvision's documented behaviour for the inputs the corpus gives it, including
where it draws random numbers (``torch.randint`` for a crop's offsets, ``torch.rand`` for a
flip), so a script's random stream is consumed as with torchvision. ``ToTensor`` also takes
the MNIST stand-in's uint8 HxW tensors (torchvision's takes PIL images and arrays only).
"""

from __future__ import annotations

import enum
import numbers

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from . import functional

__all__ = ["CenterCrop", "Compose", "ConvertImageDtype", "InterpolationMode", "Lambda",
           "Normalize", "PILToTensor", "RandomCrop", "RandomHorizontalFlip", "Resize",
           "ToTensor"]


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


_PIL = {InterpolationMode.NEAREST: Image.Resampling.NEAREST,
        InterpolationMode.NEAREST_EXACT: Image.Resampling.NEAREST,
        InterpolationMode.BILINEAR: Image.Resampling.BILINEAR,
        InterpolationMode.BICUBIC: Image.Resampling.BICUBIC,
        InterpolationMode.BOX: Image.Resampling.BOX,
        InterpolationMode.HAMMING: Image.Resampling.HAMMING,
        InterpolationMode.LANCZOS: Image.Resampling.LANCZOS}


def _size(img) -> tuple[int, int]:
    """(height, width) of a PIL image or a ...xHxW tensor."""
    if isinstance(img, Image.Image):
        return img.height, img.width
    if isinstance(img, torch.Tensor):
        return int(img.shape[-2]), int(img.shape[-1])
    raise TypeError(f"expected a PIL image or a tensor, got {type(img).__name__}")


def _pair(size) -> tuple[int, int]:
    if isinstance(size, numbers.Number):
        return int(size), int(size)
    if len(size) == 1:
        return int(size[0]), int(size[0])
    return int(size[0]), int(size[1])


def _crop(img, top: int, left: int, height: int, width: int):
    if isinstance(img, Image.Image):
        return img.crop((left, top, left + width, top + height))
    return img[..., top:top + height, left:left + width]


class Compose:
    def __init__(self, transforms) -> None:
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class Lambda:
    def __init__(self, lambd) -> None:
        if not callable(lambd):
            raise TypeError(f"Argument lambd should be callable, got {type(lambd).__name__}")
        self.lambd = lambd

    def __call__(self, x):
        return self.lambd(x)


class ToTensor:
    """A PIL image or an HxWxC uint8 array to a float CxHxW tensor in [0, 1]; a uint8 HxW (or
    HxWxC) tensor (the MNIST stand-in's items) the same way."""

    def __call__(self, pic) -> torch.Tensor:
        if isinstance(pic, torch.Tensor):
            x = pic if pic.dim() == 3 else pic.unsqueeze(-1)
            return x.permute(2, 0, 1).contiguous().float().div(255)
        if isinstance(pic, np.ndarray):
            arr = pic[:, :, None] if pic.ndim == 2 else pic
            x = torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))
            return x.float().div(255) if x.dtype == torch.uint8 else x
        if not isinstance(pic, Image.Image):
            raise TypeError(f"pic should be a PIL image or an ndarray, got {type(pic)}")
        if pic.mode not in ("L", "RGB", "RGBA", "CMYK", "YCbCr", "LAB", "HSV", "P", "1"):
            raise NotImplementedError(f"the stand-in's ToTensor takes 8-bit images, not "
                                      f"mode {pic.mode}")
        arr = np.array(pic, dtype=np.uint8, copy=True)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        return torch.from_numpy(arr).permute(2, 0, 1).contiguous().float().div(255)


class PILToTensor:
    """A PIL image to a CxHxW tensor of its own dtype (no scaling)."""

    def __call__(self, pic) -> torch.Tensor:
        return functional.pil_to_tensor(pic)


class ConvertImageDtype:
    """An image tensor to ``dtype``, integers scaled to [0, 1] by their type's maximum."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.dtype:
            return x
        if not self.dtype.is_floating_point:
            raise NotImplementedError("the stand-in converts to floating point types only")
        if x.is_floating_point():
            return x.to(self.dtype)
        return x.to(self.dtype) / torch.iinfo(x.dtype).max


class Normalize:
    def __init__(self, mean, std, inplace: bool = False) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.to(x.dtype)) / self.std.to(x.dtype)


class Resize:
    """An int ``size`` matches the shorter edge (the longer keeps the aspect ratio, truncated);
    a pair is (height, width). PIL images resample with PIL; tensors with ``interpolate``
    (antialiased for bilinear and bicubic, as torchvision's default ``antialias=True``)."""

    def __init__(self, size, interpolation=InterpolationMode.BILINEAR, max_size=None,
                 antialias=True) -> None:
        if max_size is not None:
            raise NotImplementedError("the stand-in's Resize has no max_size")
        self.size, self.antialias = size, antialias
        self.interpolation = InterpolationMode(interpolation) \
            if not isinstance(interpolation, InterpolationMode) else interpolation

    def _output(self, h: int, w: int) -> tuple[int, int]:
        if isinstance(self.size, numbers.Number) or len(self.size) == 1:
            size = int(self.size if isinstance(self.size, numbers.Number) else self.size[0])
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = size, int(size * long / short)
            return (new_long, new_short) if w <= h else (new_short, new_long)
        return int(self.size[0]), int(self.size[1])

    def __call__(self, img):
        h, w = _size(img)
        oh, ow = self._output(h, w)
        if (oh, ow) == (h, w):
            return img
        if isinstance(img, Image.Image):
            return img.resize((ow, oh), _PIL[self.interpolation])
        mode = self.interpolation.value
        if mode not in ("nearest", "nearest-exact", "bilinear", "bicubic"):
            raise NotImplementedError(f"the stand-in resizes tensors with nearest, bilinear "
                                      f"or bicubic, not {mode}")
        x = img if img.is_floating_point() else img.float()
        batched = x.reshape(-1, *x.shape[-3:]) if x.dim() >= 3 else x[None, None]
        out = F.interpolate(batched, size=(oh, ow), mode=mode,
                            align_corners=False if mode in ("bilinear", "bicubic") else None,
                            antialias=self.antialias and mode in ("bilinear", "bicubic"))
        out = out.reshape(*img.shape[:-2], oh, ow)
        if not img.is_floating_point():
            out = out.round().clamp(torch.iinfo(img.dtype).min, torch.iinfo(img.dtype).max)
        return out.to(img.dtype)


class CenterCrop:
    def __init__(self, size) -> None:
        self.size = _pair(size)

    def __call__(self, img):
        h, w = _size(img)
        th, tw = self.size
        if th > h or tw > w:
            raise NotImplementedError("the stand-in's CenterCrop does not pad")
        return _crop(img, round((h - th) / 2.0), round((w - tw) / 2.0), th, tw)


class RandomCrop:
    def __init__(self, size, padding=None, pad_if_needed=False, fill=0,
                 padding_mode="constant") -> None:
        if padding is not None or pad_if_needed:
            raise NotImplementedError("the stand-in's RandomCrop does not pad")
        self.size = _pair(size)

    @staticmethod
    def get_params(img, output_size) -> tuple[int, int, int, int]:
        h, w = _size(img)
        th, tw = output_size
        if h < th or w < tw:
            raise ValueError(f"Required crop size {(th, tw)} is larger than input image size "
                             f"{(h, w)}")
        if w == tw and h == th:
            return 0, 0, h, w
        i = torch.randint(0, h - th + 1, size=(1,)).item()
        j = torch.randint(0, w - tw + 1, size=(1,)).item()
        return i, j, th, tw

    def __call__(self, img):
        return _crop(img, *self.get_params(img, self.size))


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, img):
        if torch.rand(1) < self.p:
            if isinstance(img, Image.Image):
                return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            return img.flip(-1)
        return img
