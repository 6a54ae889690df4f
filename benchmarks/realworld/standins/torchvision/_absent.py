"""Names other libraries import from torchvision at import time (torchmetrics does when it
finds a torchvision): present so that the import succeeds, raising if anything calls them."""

from __future__ import annotations


def absent(name: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"torchvision.{name} is not part of nanhunt's stand-in")

    missing.__name__ = name.rsplit(".", 1)[-1]
    return missing
