"""The number formats nanhunt judges values against: the one table of limits.

Torch-free so that diagnosis and reports can use it on a saved trace; a unit test checks every
entry against ``torch.finfo``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FORMATS", "NumberFormat", "get_format"]


@dataclass(frozen=True)
class NumberFormat:
    """Limits of one floating-point format.

    >>> get_format("float16").max
    65504.0
    """

    name: str
    max: float  # largest finite magnitude
    smallest_normal: float  # below this, values lose precision (subnormal zone)
    smallest_subnormal: float  # below this, values flush to zero
    exponent_bits: int
    mantissa_bits: int

    @property
    def max_binade(self) -> int:
        """Binade (floor(log2)) of the largest finite value."""
        return math.floor(math.log2(self.max))

    @property
    def min_normal_binade(self) -> int:
        return round(math.log2(self.smallest_normal))

    @property
    def min_subnormal_binade(self) -> int:
        return round(math.log2(self.smallest_subnormal))

    def headroom_binades(self, amax: float) -> float:
        """How many binades (factors of two) ``amax`` may grow before exceeding ``max``."""
        if not amax > 0:
            return math.inf
        if math.isinf(amax):
            return -math.inf
        return math.log2(self.max / amax)


def _fmt(name: str, max_: float, ebits: int, mbits: int, min_normal_exp: int) -> NumberFormat:
    return NumberFormat(
        name=name,
        max=max_,
        smallest_normal=2.0**min_normal_exp,
        smallest_subnormal=2.0 ** (min_normal_exp - mbits),
        exponent_bits=ebits,
        mantissa_bits=mbits,
    )


FORMATS: dict[str, NumberFormat] = {
    f.name: f
    for f in (
        _fmt("float16", 65504.0, 5, 10, -14),
        _fmt("bfloat16", (2 - 2.0**-7) * 2.0**127, 8, 7, -126),
        _fmt("float32", (2 - 2.0**-23) * 2.0**127, 8, 23, -126),
        _fmt("float8_e4m3fn", 448.0, 4, 3, -6),
        _fmt("float8_e5m2", 57344.0, 5, 2, -14),
    )
}

_ALIASES = {
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
}


def get_format(name: str) -> NumberFormat:
    """Look up a format by name (``float16``, ``bf16``, ``torch.float16`` ...)."""
    key = str(name).removeprefix("torch.")
    key = _ALIASES.get(key, key)
    try:
        return FORMATS[key]
    except KeyError:
        from nanhunt.errors import NanhuntError

        raise NanhuntError(
            f"unknown target format {name!r} (choose from {', '.join(FORMATS)})"
        ) from None
