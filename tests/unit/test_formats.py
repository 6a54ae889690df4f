"""nanhunt.formats: the table of format limits, checked against torch.finfo."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from nanhunt import NanhuntError
from nanhunt.formats import FORMATS, NumberFormat, get_format

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

# Binades (floor(log2)) of max, smallest normal and smallest subnormal, written out by hand.
BINADES = {
    "float16": (15, -14, -24),
    "bfloat16": (127, -126, -133),
    "float32": (127, -126, -149),
    "float8_e4m3fn": (8, -6, -9),
    "float8_e5m2": (15, -14, -16),
}


def test_table_covers_exactly_the_known_formats():
    assert set(FORMATS) == set(DTYPES)
    for name, fmt in FORMATS.items():
        assert isinstance(fmt, NumberFormat)
        assert fmt.name == name


@pytest.mark.parametrize("name", list(DTYPES))
def test_limits_match_torch_finfo(name):
    fmt = FORMATS[name]
    fi = torch.finfo(DTYPES[name])
    assert fmt.max == fi.max
    assert fmt.smallest_normal == fi.smallest_normal
    assert fmt.smallest_normal == fi.tiny
    assert fmt.smallest_subnormal == fi.tiny * fi.eps
    mantissa = round(-math.log2(fi.eps))
    assert fmt.mantissa_bits == mantissa
    assert fmt.exponent_bits == fi.bits - 1 - mantissa


@pytest.mark.parametrize("name", list(DTYPES))
def test_limits_are_the_formats_own_boundaries(name):
    """max is representable and the next value up is not finite (or not representable);
    the smallest subnormal survives a round trip and half of it flushes to zero."""
    fmt = FORMATS[name]
    dt = DTYPES[name]
    # float8 casts need float32 sources; every limit here is exact in float64 and in float32.
    for v in (fmt.max, fmt.smallest_normal, fmt.smallest_subnormal):
        assert torch.tensor(v, dtype=torch.float64).to(dt).double().item() == v
        assert torch.tensor(v, dtype=torch.float32).to(dt).double().item() == v
    half = torch.tensor(fmt.smallest_subnormal / 2, dtype=torch.float64)
    assert half.to(dt).double().item() == 0.0  # ties to even: exactly half rounds to zero
    just_below_normal = torch.tensor(fmt.smallest_normal * (1 - 2.0**-30), dtype=torch.float64)
    assert just_below_normal.to(dt).double().item() <= fmt.smallest_normal


@pytest.mark.parametrize("name", list(DTYPES))
def test_binade_properties(name):
    fmt = FORMATS[name]
    assert (fmt.max_binade, fmt.min_normal_binade, fmt.min_subnormal_binade) == BINADES[name]
    assert 2.0**fmt.max_binade <= fmt.max < 2.0 ** (fmt.max_binade + 1)
    assert fmt.smallest_normal == 2.0**fmt.min_normal_binade
    assert fmt.smallest_subnormal == 2.0**fmt.min_subnormal_binade
    assert fmt.min_normal_binade - fmt.min_subnormal_binade == fmt.mantissa_bits


def test_formats_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FORMATS["float16"].max = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("float16", "float16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("torch.float16", "float16"),
        ("bfloat16", "bfloat16"),
        ("bf16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
        ("float32", "float32"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("torch.float32", "float32"),
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("e4m3", "float8_e4m3fn"),
        ("torch.float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e5m2", "float8_e5m2"),
        ("e5m2", "float8_e5m2"),
        ("torch.float8_e5m2", "float8_e5m2"),
    ],
)
def test_get_format_names_and_aliases(alias, name):
    assert get_format(alias) is FORMATS[name]


@pytest.mark.parametrize("name", list(DTYPES))
def test_get_format_accepts_torch_dtypes(name):
    assert get_format(DTYPES[name]) is FORMATS[name]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad", ["float64", "double", "int8", "fp8", "", "torch.", "float16 ", "torch.float64"]
)
def test_get_format_unknown_name_raises(bad):
    with pytest.raises(NanhuntError) as info:
        get_format(bad)
    message = str(info.value)
    assert repr(bad) in message
    for name in FORMATS:  # the message lists the choices
        assert name in message
    assert info.value.exit_code == 2


def test_get_format_unknown_dtype_raises():
    with pytest.raises(NanhuntError):
        get_format(torch.float64)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(DTYPES))
def test_headroom_binades(name):
    fmt = FORMATS[name]
    assert fmt.headroom_binades(fmt.max) == 0.0
    assert fmt.headroom_binades(fmt.max / 2) == pytest.approx(1.0)
    assert fmt.headroom_binades(fmt.max / 1024) == pytest.approx(10.0)
    assert fmt.headroom_binades(fmt.max * 4) == pytest.approx(-2.0)
    assert fmt.headroom_binades(fmt.smallest_subnormal) == pytest.approx(
        math.log2(fmt.max) - fmt.min_subnormal_binade
    )
    # Nothing non-zero to grow: unlimited headroom.  Already infinite: none at all.
    assert fmt.headroom_binades(0.0) == math.inf
    assert fmt.headroom_binades(-0.0) == math.inf
    assert fmt.headroom_binades(-1.0) == math.inf
    assert fmt.headroom_binades(math.inf) == -math.inf


def test_headroom_is_monotonic_in_amax():
    fmt = FORMATS["float16"]
    amaxes = [2.0**k for k in range(-30, 30)]
    rooms = [fmt.headroom_binades(a) for a in amaxes]
    assert rooms == sorted(rooms, reverse=True)
    assert all(
        r == pytest.approx(math.log2(65504.0) - k)
        for r, k in zip(rooms, range(-30, 30), strict=True)
    )
