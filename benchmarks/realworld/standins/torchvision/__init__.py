"""A stand-in for the few torchvision names the corpus's vision scripts import.

PyPI's torchvision does not import beside torch 2.13 here, and MNIST cannot be downloaded
offline. This package is nanhunt's own code, not torchvision's: ``datasets.MNIST`` makes a
small synthetic digit set (deterministic, no files), ``transforms`` has the conversions,
resizing, crops, flips and normalisation the scripts use, on PIL images and tensors, drawing
random numbers where torchvision does.
"""

from . import datasets, io, models, ops, transforms

__version__ = "0.0.0+nanhunt.standin"
__all__ = ["datasets", "io", "models", "ops", "transforms"]
