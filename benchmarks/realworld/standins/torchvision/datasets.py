"""``MNIST``: a synthetic stand-in with torchvision's constructor and item types."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

__all__ = ["MNIST"]

TRAIN_SIZE = 256
TEST_SIZE = 128


class MNIST(Dataset):
    """28x28 uint8 images of 10 classes: class c is a bright bar at a class-dependent row and
    column plus noise, so a small CNN can learn it. Same arguments as torchvision's."""

    def __init__(self, root: str, train: bool = True, transform=None, target_transform=None,
                 download: bool = False) -> None:
        self.root, self.train = root, train
        self.transform, self.target_transform = transform, target_transform
        g = torch.Generator().manual_seed(0 if train else 1)
        n = TRAIN_SIZE if train else TEST_SIZE
        self.targets = torch.randint(0, 10, (n,), generator=g)
        noise = torch.randint(0, 64, (n, 28, 28), generator=g, dtype=torch.uint8)
        self.data = noise
        for i, c in enumerate(self.targets.tolist()):
            self.data[i, 4 + 2 * c, 3:25] = 255
            self.data[i, 3:25, 4 + 2 * c] = 200

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        img, target = self.data[index], int(self.targets[index])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target
