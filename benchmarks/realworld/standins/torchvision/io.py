"""Import-time names only (see _absent.py): transformers' video and image utilities import
``torchvision.io`` when they find a torchvision."""

from ._absent import absent

read_video = absent("io.read_video")
decode_image = absent("io.decode_image")


class ImageReadMode:
    """Names only: decode_image is absent."""

    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4
