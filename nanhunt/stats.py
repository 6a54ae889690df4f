"""Tensor summaries computed on the tensor's own device, with no host synchronisation.

:func:`summarize` turns a floating-point tensor into a fixed-length float64 vector (one row of the
step's summary matrix); the recorder stacks a step's rows and moves them to the host in a single
transfer, where :func:`decode` turns a row into a torch-free :class:`~nanhunt.trace.TensorStats`.

Row layout: ``numel, nan, +inf, -inf, zero, finite amax, smallest non-zero finite |x|,
count of finite |x| above the target max (NaN and inf are not counted there), count of
non-zero finite |x| below the target's
smallest subnormal`` followed by a 256-bin histogram of the float32 exponent field (bin 0: zeros
and values below 2**-126, float32 subnormals included; bin 255: inf and NaN; bin k: binade
k-127). float64 values of 2**128 or more (beyond float32's range) are counted in binade 127.

Nothing here reads a value back to the host: every op has an output shape that depends only on
the input's shape (the function also runs on ``meta`` tensors), so a step's rows can be stacked
and copied to the host in one transfer.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from nanhunt.formats import NumberFormat
from nanhunt.trace import TensorStats

__all__ = ["ROW_LEN", "decode", "summarizable", "summarize"]

_HEAD = 9
_BINS = 256
ROW_LEN = _HEAD + _BINS

_NUMEL, _NAN, _POSINF, _NEGINF, _ZERO, _AMAX, _AMIN, _ABOVE, _FLUSHED = range(_HEAD)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def summarizable(t: object) -> bool:
    """Dense floating-point tensors nanhunt summarises (not integer, bool, complex, fp8 storage,
    sparse or meta tensors)."""
    return (
        isinstance(t, torch.Tensor)
        and t.dtype in _FLOATS
        and t.layout == torch.strided
        and not t.is_meta
    )


def _exponent_field(f: torch.Tensor) -> torch.Tensor:
    """float32 exponent field (0..255) of each element; float64 goes through frexp, with binades
    below -126 in field 0 and binades above 127 in field 254."""
    if f.dtype == torch.float64:
        _, e = torch.frexp(f)
        field = (e.to(torch.int32) + 126).clamp_(0, 254)
        field = torch.where(f == 0, 0, field)
        return torch.where(torch.isfinite(f), field, 255)
    return (f.view(torch.int32) >> 23) & 0xFF


_ABS = 0x7FFFFFFF  # float32 bits without the sign
_INF_BITS = 0x7F800000  # |x| bits of inf; above it: NaN
_NEGINF_BITS = -8388608  # -inf's bits as int32
_MIN_NORMAL_BITS = 0x00800000  # 2**-126, float32's smallest normal


def _bits32(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _float32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


@torch.no_grad()
def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (FSDP2, tensor parallel), else ``t``: statistics are
    computed on the local values (a DTensor op would need a collective, and has no rule for
    some ops, such as bincount)."""
    if type(t).__name__ == "DTensor" and hasattr(t, "to_local"):
        return t.to_local()
    return t


def summarize(t: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """One float64 row of statistics for ``t``, on ``t``'s device, without syncing the host
    (a DTensor's local shard)."""
    x = local(t.detach())
    n = x.numel()
    if n == 0:
        row = torch.zeros(ROW_LEN, dtype=torch.float64, device=x.device)
        row[_AMIN] = float("inf")
        return row
    if x.dtype == torch.float64:
        return _summarize_generic(x.reshape(-1), fmt)
    f = x.reshape(-1)
    if f.dtype != torch.float32:
        f = f.float()  # every fp16/bf16 value is exact in float32, subnormals included
    if f.device.type == "cpu":
        return _summarize_cpu(f, fmt)
    return _summarize_device(f, fmt)


def _summarize_cpu(f: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """CPU tensors: reading a value back costs no device sync, so the histogram decides which
    passes are needed; a finite tensor takes four (abs bits, exponent, histogram, min/max)."""
    bits = f.view(torch.int32)
    ab = bits & _ABS
    hist = torch.bincount(ab >> 23, minlength=_BINS)
    counts = hist.tolist()
    count = torch.count_nonzero
    nonfinite = counts[_BINS - 1]
    nan = neginf = zero = 0
    finite_ab = ab
    if nonfinite:
        nan = int(count(ab > _INF_BITS))
        neginf = int(count(bits == _NEGINF_BITS))
        finite_ab = torch.where(ab < _INF_BITS, ab, 0)
    if counts[0]:  # zeros, or float32 subnormals
        # zeros wrap to the top under (x - 1) & 0x7fffffff, so amin finds the smallest non-zero
        amin = min(int(ab.sub(1).bitwise_and_(_ABS).amin()) + 1, _INF_BITS)
        amax = int(finite_ab.amax())
        # no non-zero value below 2**-126: bin 0 holds only zeros
        zero = counts[0] if amin >= _MIN_NORMAL_BITS else int(count(ab == 0))
    elif nonfinite:
        amax = int(finite_ab.amax())
        amin = min(int(ab.amin()), _INF_BITS)
    else:
        low, high = torch.aminmax(ab)
        amin, amax = int(low), int(high)
    max_bits, flush_bits = _bits32(fmt.max), _bits32(fmt.smallest_subnormal)
    above = int(count(ab > max_bits)) - nonfinite if amax > max_bits else 0
    subnormal32 = counts[0] - zero
    if flush_bits >= _MIN_NORMAL_BITS:  # a power of two among the normal binades: exact
        flushed = sum(counts[1:flush_bits >> 23]) + subnormal32
    elif subnormal32:
        flushed = int(count(ab < flush_bits)) - zero
    else:
        flushed = 0
    head = torch.tensor(
        [f.numel(), nan, nonfinite - nan - neginf, neginf, zero, _float32(amax),
         _float32(amin), above, flushed],
        dtype=torch.float64,
    )
    return torch.cat([head, torch.tensor(counts, dtype=torch.float64)])


def _summarize_device(f: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """Accelerators: the same row from integer ops on the float32 bit pattern, never reading a
    value back. A histogram by scatter_add_, not bincount: bincount sizes its output from the
    data, which on CUDA reads the input's max back to the host (a sync per tensor)."""
    device = f.device
    bits = f.view(torch.int32)
    ab = bits & _ABS
    field = (ab >> 23).long()
    hist = torch.zeros(_BINS, dtype=torch.int64, device=device)
    hist.scatter_add_(0, field, torch.ones((), dtype=torch.int64, device=device).expand_as(field))
    count = torch.count_nonzero
    nonfinite = hist[_BINS - 1]
    nan = count(ab > _INF_BITS)
    neginf = count(bits == _NEGINF_BITS)
    zero = count(ab == 0)
    above = count(ab > _bits32(fmt.max)) - nonfinite
    flushed = count(ab < _bits32(fmt.smallest_subnormal)) - zero
    amax = torch.where(ab < _INF_BITS, ab, 0).amax().view(torch.float32)
    amin = torch.where(ab == 0, _INF_BITS, ab).amin().clamp_(max=_INF_BITS).view(torch.float32)
    head = torch.stack([
        torch.full((), float(f.numel()), dtype=torch.float64, device=device),
        nan.double(), (nonfinite - nan - neginf).double(), neginf.double(), zero.double(),
        amax.double(), amin.double(), above.double(), flushed.double(),
    ])
    return torch.cat([head, hist.double()])


def _summarize_generic(f: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """Any floating dtype (float64) through float ops; sync-free."""
    device = f.device
    field = _exponent_field(f).long()
    hist = torch.zeros(_BINS, dtype=torch.int64, device=device)
    hist.scatter_add_(0, field, torch.ones((), dtype=torch.int64, device=device).expand_as(field))
    a = f.abs()
    nan = torch.isnan(f).sum()
    neginf = (f == float("-inf")).sum()
    posinf = hist[_BINS - 1] - nan - neginf
    zero = (a == 0).sum()
    finite = a.nan_to_num(nan=0.0, posinf=0.0)
    nonzero = finite > 0
    amax = finite.amax()
    amin = torch.where(nonzero, finite, float("inf")).amin()
    above = (finite > fmt.max).sum()
    # Exact, not from the histogram: bin 0 lumps everything below 2**-126, and a target's flush
    # threshold can lie inside it (bfloat16: 2**-133, float32: 2**-149).
    flushed = (nonzero & (finite < fmt.smallest_subnormal)).sum()
    head = torch.stack(
        [
            torch.full((), float(f.numel()), dtype=torch.float64, device=device),
            nan.double(),
            posinf.double(),
            neginf.double(),
            zero.double(),
            amax.double(),
            amin.double(),
            above.double(),
            flushed.double(),
        ]
    )
    return torch.cat([head, hist.double()])


def decode(
    row: Sequence[float], dtype: str, shape: Sequence[int], fmt: NumberFormat
) -> TensorStats:
    """Host-side :class:`TensorStats` from one row made by :func:`summarize`."""
    vals = [float(v) for v in row[:_HEAD]]
    counts = [int(v) for v in row[_HEAD:ROW_LEN]]
    zero = int(vals[_ZERO])
    nan, posinf, neginf = int(vals[_NAN]), int(vals[_POSINF]), int(vals[_NEGINF])
    hist: dict[int, int] = {}
    subnormal32 = counts[0] - zero
    if subnormal32:
        hist[-127] = subnormal32
    for field in range(1, _BINS - 1):
        if counts[field]:
            hist[field - 127] = counts[field]
    # Every target's smallest normal is a power of two of at least 2**-126, so the histogram
    # (exact down to binade -126) gives underflow exactly.
    underflow = sum(c for e, c in hist.items() if e < fmt.min_normal_binade)
    amax = vals[_AMAX]
    return TensorStats(
        dtype=str(dtype).removeprefix("torch."),
        shape=list(shape),
        numel=int(vals[_NUMEL]),
        nan=nan,
        posinf=posinf,
        neginf=neginf,
        zero=zero,
        amax=amax,
        amin=vals[_AMIN],
        overflow=int(vals[_ABOVE]),  # finite values only: a NaN is not "over the max"
        underflow=underflow,
        flushed=int(vals[_FLUSHED]),
        headroom=fmt.headroom_binades(amax),
        hist=hist,
    )
