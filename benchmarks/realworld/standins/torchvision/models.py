"""Import-time names only (see _absent.py)."""

from ._absent import absent

resnet50 = absent("models.resnet50")
vgg16 = absent("models.vgg16")
VGG16_Weights = absent("models.VGG16_Weights")
