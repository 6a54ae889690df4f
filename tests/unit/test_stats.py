"""nanhunt.stats: on-device summaries checked against an independent numpy float64 reference.

The reference (:func:`reference`) works on the tensor's values after conversion to its own dtype,
read out as float64 (exact for every supported dtype), and on the target's limits taken from
``torch.finfo`` - it calls no nanhunt code.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nanhunt.stats as stats_module
from nanhunt.formats import get_format
from nanhunt.stats import ROW_LEN, decode, summarizable, summarize
from nanhunt.trace import TensorStats

INPUTS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
TARGETS = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]

F32_MAX = float(np.finfo(np.float32).max)
BF16_MAX = (2 - 2.0**-7) * 2.0**127

# --------------------------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------------------------


def limits(target: torch.dtype) -> tuple[float, float, float]:
    """(max, smallest normal, smallest subnormal) of a target, straight from torch.finfo."""
    fi = torch.finfo(target)
    return fi.max, fi.smallest_normal, fi.tiny * fi.eps


def reference(x: np.ndarray, target: torch.dtype) -> dict:
    """Expected TensorStats fields for the values ``x`` (float64) judged against ``target``."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    tmax, tnormal, tsub = limits(target)
    nan = int(np.isnan(x).sum())
    posinf = int((x == np.inf).sum())
    neginf = int((x == -np.inf).sum())
    a = np.abs(x[np.isfinite(x)])
    nz = a[a > 0]
    amax = float(a.max()) if a.size else 0.0
    hist: Counter[int] = Counter()
    if nz.size:
        _, e = np.frexp(nz)  # nz = m * 2**e with 0.5 <= m < 1, so the binade is e - 1
        binade = np.clip(e.astype(np.int64) - 1, -127, 127)  # >127 only for float64 inputs
        hist.update(int(b) for b in binade)
    return {
        "numel": int(x.size),
        "nan": nan,
        "posinf": posinf,
        "neginf": neginf,
        "zero": int((x == 0).sum()),  # -0 == 0
        "amax": amax,
        "amin": float(nz.min()) if nz.size else math.inf,
        "overflow": int((a[np.isfinite(a)] > tmax).sum()),
        "underflow": int((nz < tnormal).sum()),
        "flushed": int((nz < tsub).sum()),
        "headroom": math.log2(tmax / amax) if amax > 0 else math.inf,
        "hist": dict(hist),
        "finite_nonzero": int(nz.size),
    }


def check(stats: TensorStats, ref: dict) -> None:
    for key in ("numel", "nan", "posinf", "neginf", "zero", "overflow", "underflow", "flushed"):
        assert getattr(stats, key) == ref[key], key
    assert stats.amax == ref["amax"]
    assert stats.amin == ref["amin"]
    if math.isinf(ref["headroom"]):
        assert stats.headroom == ref["headroom"]
    else:
        assert stats.headroom == pytest.approx(ref["headroom"], rel=1e-12, abs=1e-12)
    assert stats.hist == ref["hist"]
    assert stats.finite_nonzero == ref["finite_nonzero"]
    assert stats.nonfinite == ref["nan"] + ref["posinf"] + ref["neginf"]
    for key in ("numel", "nan", "posinf", "neginf", "zero", "overflow", "underflow", "flushed"):
        assert type(getattr(stats, key)) is int, key
    assert all(type(k) is int and type(v) is int and v > 0 for k, v in stats.hist.items())


def values_of(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as float64 numpy (exact for float16/bfloat16/float32/float64)."""
    return t.detach().to(torch.float64).numpy()


def run(t: torch.Tensor, target: torch.dtype) -> TensorStats:
    row = summarize(t, get_format(target))
    if t.numel() and t.dtype != torch.float64:
        # the accelerator path (sync-free, used off the CPU) gives the same row
        device_row = stats_module._summarize_device(t.detach().reshape(-1).float(),
                                                    get_format(target))
        assert torch.equal(row, device_row)
    assert isinstance(row, torch.Tensor)
    assert row.dtype == torch.float64
    assert row.shape == (ROW_LEN,)
    assert row.device == t.device
    return decode(row.tolist(), str(t.dtype), t.shape, get_format(target))


# --------------------------------------------------------------------------------------------
# Value generation
# --------------------------------------------------------------------------------------------

SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0]
EDGES = [
    # float16: max, the rounding boundary to inf, smallest normal/subnormal and around them
    65504.0,
    65505.0,
    65519.0,
    65520.0,
    65536.0,
    2.0**-14,
    2.0**-14 - 2.0**-24,
    2.0**-24,
    2.0**-25,
    1.5 * 2.0**-25,
    2.0**-26,
    # bfloat16 / float32
    BF16_MAX,
    F32_MAX,
    2.0**127,
    2.0**-126,
    2.0**-126 - 2.0**-149,
    2.0**-127,
    2.0**-133,
    2.0**-134,
    2.0**-140,
    2.0**-149,
    2.0**-150,
    # float8
    448.0,
    449.0,
    464.0,
    480.0,
    57344.0,
    61440.0,
    2.0**-6,
    2.0**-9,
    2.0**-10,
    2.0**-16,
    2.0**-17,
    # only float64 keeps these
    2.0**128,
    1e300,
    1e-300,
    5e-324,
    1.0,
]
edge = st.sampled_from(EDGES).flatmap(lambda v: st.sampled_from([v, -v]))
any_binade = st.builds(
    lambda sign, m, k: sign * m * 2.0**k,
    st.sampled_from([1.0, -1.0]),
    st.floats(1.0, 2.0, exclude_max=True),
    st.integers(-160, 140),
)
element = st.one_of(
    st.sampled_from(SPECIAL),
    edge,
    any_binade,
    any_binade,
    st.floats(width=16),
    st.floats(width=32),
    st.floats(),
)


def to_dtype(values: list[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(dtype)


@st.composite
def matrices(draw) -> list[list[float]]:
    rows = draw(st.integers(1, 7))
    cols = draw(st.integers(1, 7))
    flat = draw(st.lists(element, min_size=rows * cols, max_size=rows * cols))
    return [flat[r * cols : (r + 1) * cols] for r in range(rows)]


# Each view: how torch makes it, and the same view of the values in numpy.
VIEWS = {
    "contiguous": (lambda t: t, lambda a: a),
    "transposed": (lambda t: t.t(), lambda a: a.T),
    "strided": (lambda t: t[::2, 1::3], lambda a: a[::2, 1::3]),
    "sliced": (lambda t: t[:, 1:], lambda a: a[:, 1:]),
    "column": (lambda t: t[:, -1], lambda a: a[:, -1]),
    "expanded": (lambda t: t[:, :1].expand(-1, 3), lambda a: np.repeat(a[:, :1], 3, axis=1)),
    "zero_d": (lambda t: t[-1, -1], lambda a: a[-1, -1]),
    "empty": (lambda t: t[:0], lambda a: a[:0]),
}

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)

# --------------------------------------------------------------------------------------------
# Property tests against the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS, ids=str)
@pytest.mark.parametrize("dtype", INPUTS, ids=str)
@SETTINGS
@given(values=st.lists(element, max_size=80))
def test_summary_matches_reference(dtype, target, values):
    t = to_dtype(values, dtype)
    check(run(t, target), reference(values_of(t), target))


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
@settings(max_examples=60, deadline=None, database=None)
@given(
    m=matrices(),
    view=st.sampled_from(sorted(VIEWS)),
    target=st.sampled_from(TARGETS),
)
def test_views_match_reference(dtype, m, view, target):
    base = to_dtype([v for row in m for v in row], dtype).reshape(len(m), len(m[0]))
    before = base.clone()
    make_t, make_a = VIEWS[view]
    t = make_t(base)
    stats = run(t, target)
    check(stats, reference(make_a(values_of(base)), target))
    assert stats.shape == list(t.shape)
    assert stats.dtype == str(dtype).removeprefix("torch.")
    # summarize leaves its input alone (bit for bit, NaN payloads and -0 included)
    assert torch.equal(base.view(-1).view(torch.uint8), before.view(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
@settings(max_examples=40, deadline=None, database=None)
@given(
    a=st.lists(element, max_size=40),
    b=st.lists(element, max_size=40),
    target=st.sampled_from(TARGETS),
)
def test_merged_matches_reference_on_concatenation(dtype, a, b, target):
    ta, tb = to_dtype(a, dtype), to_dtype(b, dtype)
    merged = run(ta, target).merged(run(tb, target))
    check(merged, reference(np.concatenate([values_of(ta), values_of(tb)]), target))
    assert merged.dtype == str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# Hand-written cases at the limits (readable regression tests)
# --------------------------------------------------------------------------------------------


def stats_of(values, dtype, target) -> TensorStats:
    return run(to_dtype(values, dtype), target)


def test_float16_target_limits():
    s = stats_of(
        [65504.0, 65505.0, 65520.0, -70000.0, 2.0**-14, 2.0**-15, 2.0**-24, 2.0**-25, 2.0**-30],
        torch.float32,
        torch.float16,
    )
    assert s.overflow == 3  # 65505, 65520, -70000: above the float16 max, whether or not rounded
    assert s.underflow == 4  # 2**-15, 2**-24, 2**-25, 2**-30
    assert s.flushed == 2  # 2**-25, 2**-30
    assert s.amax == 70000.0
    assert s.amin == 2.0**-30
    assert s.headroom == pytest.approx(math.log2(65504 / 70000))
    assert s.hist == {16: 1, 15: 3, -14: 1, -15: 1, -24: 1, -25: 1, -30: 1}


def test_float16_input_special_values():
    s = stats_of(
        [math.nan, math.inf, -math.inf, 0.0, -0.0, 65520.0, 2.0**-25, 2.0**-24],
        torch.float16,
        torch.float16,
    )
    # in float16 itself 65520 is +inf and 2**-25 (a tie) rounds to zero
    assert (s.nan, s.posinf, s.neginf, s.zero) == (1, 2, 1, 3)
    assert s.overflow == 0  # the NaN and the three infs are counted apart, not "over the max"
    assert (s.underflow, s.flushed) == (1, 0)
    assert s.amax == s.amin == 2.0**-24
    assert s.hist == {-24: 1}


def test_bfloat16_target_counts_float32_subnormals_exactly():
    """float32 subnormals straddle bfloat16's flush threshold 2**-133: only those below it flush
    (the histogram lumps them all into binade -127, so this must not come from the histogram)."""
    vals = [2.0**-149, 2.0**-140, 2.0**-134, 2.0**-133, 2.0**-130, 2.0**-127, 2.0**-126]
    s = stats_of(vals, torch.float32, torch.bfloat16)
    assert s.hist == {-127: 6, -126: 1}
    assert s.underflow == 6
    assert s.flushed == 3
    assert s.amin == 2.0**-149


def test_float32_target_flushes_no_float32_value():
    vals = [2.0**-149, 2.0**-140, 2.0**-127, 2.0**-126 - 2.0**-149, 2.0**-126]
    s = stats_of(vals, torch.float32, torch.float32)
    assert (s.underflow, s.flushed, s.overflow) == (4, 0, 0)
    assert s.headroom == pytest.approx(math.log2(F32_MAX / 2.0**-126))


def test_bfloat16_target_overflow_between_bf16_and_f32_max():
    s = stats_of([BF16_MAX, F32_MAX, -F32_MAX], torch.float32, torch.bfloat16)
    assert s.overflow == 2
    assert s.amax == F32_MAX
    assert s.headroom < 0
    assert s.hist == {127: 3}


def test_float64_input_beyond_float32_range():
    s = stats_of([1e300, -(2.0**128), 1e-300, 5e-324, 2.0**-140], torch.float64, torch.float32)
    assert s.overflow == 2
    assert s.flushed == 2  # 1e-300 and 5e-324 are below float32's smallest subnormal
    assert s.underflow == 3
    assert s.hist == {127: 2, -127: 3}  # documented: binades above 127 are counted in 127
    assert s.amax == 1e300
    assert s.amin == 5e-324


@pytest.mark.parametrize(
    ("target", "over", "under", "flushed"),
    [
        (torch.float8_e4m3fn, 2, 3, 1),  # max 448; normal 2**-6; subnormal 2**-9
        (torch.float8_e5m2, 1, 0, 0),  # max 57344; normal 2**-14; subnormal 2**-16
    ],
)
def test_float8_targets(target, over, under, flushed):
    s = stats_of(
        [448.0, 449.0, 60000.0, 2.0**-6, 2.0**-7, 2.0**-9, 2.0**-10], torch.float16, target
    )
    assert (s.overflow, s.underflow, s.flushed) == (over, under, flushed)
    assert s.amax == 60000.0
    assert s.amin == 2.0**-10


# --------------------------------------------------------------------------------------------
# Empty, 0-d, dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)])
@pytest.mark.parametrize("dtype", INPUTS, ids=str)
@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_empty(shape, dtype, target):
    t = torch.empty(shape, dtype=dtype)
    s = run(t, target)
    assert s == TensorStats(dtype=str(dtype).removeprefix("torch."), shape=list(shape), numel=0)
    assert (s.amax, s.amin, s.headroom, s.hist) == (0.0, math.inf, math.inf, {})
    assert s.underflow_fraction == s.flushed_fraction == 0.0
    check(s, reference(np.empty(0), target))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, -0.0, 3.0, -(2.0**-20)])
@pytest.mark.parametrize("dtype", INPUTS, ids=str)
def test_zero_d(value, dtype):
    t = torch.tensor(value, dtype=dtype)
    assert t.dim() == 0
    s = run(t, torch.float16)
    assert s.shape == []
    check(s, reference(values_of(t), torch.float16))


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
def test_summarizable_floats(dtype):
    assert summarizable(torch.zeros(3, dtype=dtype))
    assert summarizable(torch.zeros((), dtype=dtype))
    assert summarizable(torch.zeros(0, dtype=dtype))
    assert summarizable(torch.zeros(4, 5, dtype=dtype).t()[::2])
    assert summarizable(torch.zeros(3, dtype=dtype, requires_grad=True))


def _sparse_csr() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Sparse CSR tensor support is in beta state"
        return torch.zeros(3, 3).to_sparse_csr()


@pytest.mark.parametrize(
    "t",
    [
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(3, dtype=torch.int32),
        torch.zeros(3, dtype=torch.int8),
        torch.zeros(3, dtype=torch.uint8),
        torch.zeros(3, dtype=torch.bool),
        torch.tensor(True),
        torch.tensor(7),
        torch.zeros(3, dtype=torch.complex64),
        torch.zeros(3, dtype=torch.float8_e4m3fn),
        torch.zeros(3, dtype=torch.float8_e5m2),
        torch.zeros(3, device="meta"),
        torch.zeros(3, 3).to_sparse(),
        _sparse_csr(),
    ],
    ids=lambda t: f"{t.dtype}-{t.layout}-{t.device}",
)
def test_not_summarizable_tensors(t):
    assert not summarizable(t)


@pytest.mark.parametrize("obj", [None, 1.0, 3, [1.0, 2.0], np.zeros(3), "x"])
def test_not_summarizable_objects(obj):
    assert not summarizable(obj)


def test_requires_grad_input_is_not_tracked():
    t = torch.tensor([1.0, -4.0, 0.5], requires_grad=True)
    row = summarize(t * 2, get_format("fp16"))
    assert not row.requires_grad
    assert row.grad_fn is None


# --------------------------------------------------------------------------------------------
# Row format and host synchronisation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
@pytest.mark.parametrize("shape", [(5,), (2, 3), (), (0,)])
def test_summarize_runs_on_meta_tensors(dtype, shape):
    """An op that reads data back to the host (``.item()``, bincount's data-dependent size,
    boolean-mask indexing ...) cannot run on ``meta``; everything in summarize must."""
    t = torch.empty(shape, dtype=dtype, device="meta")
    row = summarize(t, get_format("fp16"))
    assert row.is_meta
    assert row.shape == (ROW_LEN,)
    assert row.dtype == torch.float64


def test_accelerator_paths_never_read_values_from_python(monkeypatch):
    """Off the CPU, summarize must not read a value back (that would sync the device). The CPU
    path may: reading a CPU tensor costs no synchronisation, and it lets it skip passes."""

    def forbidden(*args, **kwargs):
        raise AssertionError("summarize read a tensor value on the host")

    for name in ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for dtype in INPUTS:
        t = torch.tensor([1.0, math.nan, -math.inf, 0.0, 2.0**-20], dtype=dtype)
        flat = t.reshape(-1)
        if dtype == torch.float64:
            row = stats_module._summarize_generic(flat, get_format("bf16"))
        else:
            row = stats_module._summarize_device(flat.float(), get_format("bf16"))
        assert isinstance(row, torch.Tensor)
        assert row.shape == (ROW_LEN,)
        assert row.dtype == torch.float64


def test_rows_stack_and_decode_like_the_recorder():
    fmt = get_format("float16")
    tensors = [
        torch.tensor([1.0, math.nan], dtype=torch.float16),
        torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t(),
        torch.empty(0),
        torch.tensor(7e4, dtype=torch.float64),
    ]
    matrix = torch.stack([summarize(t, fmt) for t in tensors])
    assert matrix.shape == (len(tensors), ROW_LEN)
    host = matrix.tolist()  # the single transfer
    for t, row in zip(tensors, host, strict=True):
        check(decode(row, str(t.dtype), t.shape, fmt), reference(values_of(t), torch.float16))


def test_decode_accepts_tensor_list_and_numpy_rows():
    fmt = get_format("bfloat16")
    t = torch.tensor([[1.0, -3.0], [math.inf, 2.0**-140]])
    row = summarize(t, fmt)
    expected = decode(row.tolist(), "torch.float32", t.shape, fmt)
    assert decode(row, "torch.float32", t.shape, fmt) == expected
    assert decode(row.numpy(), "float32", list(t.shape), fmt) == expected
    assert expected.dtype == "float32"
    assert expected.shape == [2, 2]
    check(expected, reference(values_of(t), torch.bfloat16))


def test_merged_with_none_and_mixed_dtypes():
    fmt = get_format("float16")
    a = run(torch.tensor([1.0, 2.0], dtype=torch.float16), torch.float16)
    b = run(torch.tensor([math.nan, 1e5], dtype=torch.float32), torch.float16)
    assert a.merged(None) is a
    m = a.merged(b)
    assert m.dtype == "mixed"
    assert m.shape == []
    check(m, reference(np.array([1.0, 2.0, math.nan, 1e5]), torch.float16))
    assert m.headroom == fmt.headroom_binades(1e5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", INPUTS, ids=str)
def test_cuda_summarize_does_not_sync_and_matches_cpu(dtype):
    fmt = get_format("float16")
    cpu = to_dtype([1.0, math.nan, math.inf, -math.inf, 0.0, -0.0, 7e4, 2.0**-20, 2.0**-30], dtype)
    gpu = cpu.cuda()
    empty = torch.empty(0, dtype=dtype, device="cuda")
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        row = summarize(gpu, fmt)
        summarize(gpu.reshape(3, 3).t(), fmt)
        summarize(empty, fmt)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert row.device == gpu.device
    assert torch.equal(row.cpu(), summarize(cpu, fmt))
