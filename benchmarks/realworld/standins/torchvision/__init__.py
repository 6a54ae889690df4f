"""A stand-in for the few torchvision names the corpus's vision scripts import.

PyPI's torchvision does not import beside torch 2.13 here, and MNIST cannot be downloaded
offline. This package is nanhunt's own code, not torchvision's: ``datasets.MNIST`` makes a
small synthetic digit set (deterministic, no files), ``transforms`` converts and normalises
as torchvision's ``ToTensor``/``Normalize`` do for a uint8 image.
"""

from . import datasets, models, ops, transforms

__version__ = "0.0.0+nanhunt.standin"
__all__ = ["datasets", "models", "ops", "transforms"]
