"""``Compose``, ``ToTensor`` and ``Normalize`` for the stand-in's uint8 tensor images."""

from __future__ import annotations

import torch

__all__ = ["Compose", "Normalize", "ToTensor"]


class Compose:
    def __init__(self, transforms) -> None:
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    """A uint8 HxW (or HxWxC) image to a float CxHxW tensor in [0, 1]."""

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        x = img if img.dim() == 3 else img.unsqueeze(-1)
        return x.permute(2, 0, 1).contiguous().float().div(255)


class Normalize:
    def __init__(self, mean, std) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std
