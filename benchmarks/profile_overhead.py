"""Where nanhunt's per-step cost goes, on one model (default: the transformer, fp32, CPU).

Run from the repository root::

    python benchmarks/profile_overhead.py [--model transformer] [--repeats 3]

It times, in CPU seconds and interleaved, a plain step against full tracing with
:func:`nanhunt.stats.summarize` as it is, replaced by a constant row (what remains is Python
hooks, records and the host-side decode), and replaced by two faster prototypes defined here
(checked to give identical rows first), then the untraced steps of sampled mode. It then lists
which tensors were summarised, by role and module type, and the top nanhunt functions under
cProfile. This is a developer tool: it patches nanhunt's internals and may need updating when
they change.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import overhead

import nanhunt
from nanhunt import capture as _capture
from nanhunt import stats as _stats
from nanhunt.formats import NumberFormat

_ABS = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_NEGINF_BITS = -8388608  # float32 -inf seen as int32


def _bits32(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.float32).view(torch.int32))


def _head(n: int, device: torch.device, *values: torch.Tensor) -> torch.Tensor:
    n_t = torch.full((), float(n), dtype=torch.float64, device=device)
    return torch.stack([n_t, *(v.double() for v in values)])


@torch.no_grad()
def summarize_bits(t: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """Sync-free like the original, on the float32 bit pattern: integer compares counted with
    count_nonzero (no bool -> int64 copies), bincount on CPU."""
    x = t.detach()
    if x.dtype == torch.float64 or x.numel() == 0:
        return _stats.summarize(t, fmt)
    f = x.reshape(-1)
    if f.dtype != torch.float32:
        f = f.float()
    bits = f.view(torch.int32)
    ab = bits & _ABS
    field = ab >> 23
    if f.device.type == "cpu":
        hist = torch.bincount(field, minlength=_stats._BINS)
    else:
        hist = torch.zeros(_stats._BINS, dtype=torch.int64, device=f.device)
        ones = torch.ones((), dtype=torch.int64, device=f.device).expand_as(field)
        hist.scatter_add_(0, field.long(), ones)
    count = torch.count_nonzero
    nonfinite = hist[_stats._BINS - 1]
    nan = count(ab > _INF_BITS)
    neginf = count(bits == _NEGINF_BITS)
    zero = count(ab == 0)
    above = count(ab > _bits32(fmt.max)) - nonfinite
    flushed = count(ab < _bits32(fmt.smallest_subnormal)) - zero
    amax = torch.where(ab < _INF_BITS, ab, 0).amax().view(torch.float32)
    amin = torch.where(ab == 0, _INF_BITS, ab).amin().clamp_(max=_INF_BITS).view(torch.float32)
    posinf = nonfinite - nan - neginf
    head = _head(f.numel(), f.device, nan, posinf, neginf, zero, amax, amin, above, flushed)
    return torch.cat([head, hist.double()])


@torch.no_grad()
def summarize_cpu_branching(t: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """CPU tensors only: reading a CPU value costs no device sync, so the histogram decides
    which passes to skip (no NaN/inf, no zero, nothing near the target's limits: 5 passes)."""
    x = t.detach()
    if x.device.type != "cpu" or x.dtype == torch.float64 or x.numel() == 0:
        return summarize_bits(t, fmt)
    f = x.reshape(-1)
    if f.dtype != torch.float32:
        f = f.float()
    bits = f.view(torch.int32)
    ab = bits & _ABS
    hist = torch.bincount(ab >> 23, minlength=_stats._BINS)
    nonfinite = int(hist[_stats._BINS - 1])
    nan = neginf = 0
    if nonfinite:
        nan = int(torch.count_nonzero(ab > _INF_BITS))
        neginf = int(torch.count_nonzero(bits == _NEGINF_BITS))
        amax = int(torch.where(ab < _INF_BITS, ab, 0).amax())
    else:
        amax = int(ab.amax())
    zero = int(torch.count_nonzero(ab == 0)) if int(hist[0]) else 0
    if zero or nonfinite:  # smallest non-zero: zeros wrap to the top under (x - 1) & 0x7fffffff
        amin = min(int(ab.sub(1).bitwise_and_(_ABS).amin()) + 1, _INF_BITS)
    else:
        amin = int(ab.amin())
    max_bits, flush_bits = _bits32(fmt.max), _bits32(fmt.smallest_subnormal)
    above = int(torch.count_nonzero(ab > max_bits)) - nonfinite if amax > max_bits else 0
    flushed = int(torch.count_nonzero(ab < flush_bits)) - zero if amin < flush_bits else 0
    amax_f, amin_f = torch.tensor([amax, amin], dtype=torch.int32).view(torch.float32).tolist()
    posinf = nonfinite - nan - neginf
    head = torch.tensor(
        [f.numel(), nan, posinf, neginf, zero, amax_f, amin_f, above, flushed],
        dtype=torch.float64,
    )
    return torch.cat([head, hist.double()])


def check_prototypes() -> int:
    """Both prototypes give nanhunt's rows exactly, on special values in every target."""
    g = torch.Generator().manual_seed(0)
    specials = torch.tensor(
        [0.0, -0.0, 1.0, -2.0, float("nan"), float("inf"), float("-inf"), 7e4, -7e4, 65504.0,
         65505.0, 1e-8, -1e-8, 2**-24, 2**-25, 1e-40, -1e-45, 3e38, -3e38]
    )  # fmt: skip
    checked = 0
    for target in ("float16", "bfloat16", "float32"):
        fmt = nanhunt.get_format(target)
        for _ in range(100):
            k = int(torch.randint(1, 40, (1,), generator=g))
            scale = 10.0 ** int(torch.randint(-45, 39, (1,), generator=g))
            pick = specials[torch.randint(0, len(specials), (k,), generator=g)]
            t = torch.cat([pick, torch.randn(k, generator=g) * scale])
            t = t[torch.randperm(len(t), generator=g)][: int(torch.randint(1, 2 * k, (1,)))]
            for x in (t, t.half(), t.bfloat16(), t.relu()):
                want = _stats.summarize(x, fmt)
                for fn in (summarize_bits, summarize_cpu_branching):
                    got = fn(x, fmt)
                    assert torch.equal(want, got), (fn.__name__, target, x, want[:9], got[:9])
                checked += 1
    return checked


def time_configs(w: overhead.Workload, repeats: int) -> dict[str, list[float]]:
    zero_row = torch.zeros(_stats.ROW_LEN, dtype=torch.float64)
    original = _stats.summarize
    configs: dict[str, tuple[Callable | None, int]] = {
        "plain": (None, 1),
        "full tracing": (original, 1),
        "  summarize -> constant row": (lambda t, fmt: zero_row, 1),
        "  summarize -> bit-ops prototype": (summarize_bits, 1),
        "  summarize -> CPU-branching prototype": (summarize_cpu_branching, 1),
        "sampled, untraced steps": (original, 1000),
    }
    out: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(repeats):
        for name, (fn, every) in configs.items():
            if fn is None:
                for _ in range(2):
                    c = time.process_time()
                    w.step()
                    out[name].append(time.process_time() - c)
                continue
            _stats.summarize = fn
            try:
                with nanhunt.watch(w.model, w.optimizer, w.scaler, sample_every=every):
                    for i in range(3 if every > 1 else 2):
                        c = time.process_time()
                        w.step()
                        if every == 1 or i > 0:  # sampled: step 0 is the traced one
                            out[name].append(time.process_time() - c)
            finally:
                _stats.summarize = original
    return out


def rows_by_role(w: overhead.Workload) -> list[tuple[str, str, int, int]]:
    """What one traced step summarises: (role, module type, rows, elements)."""
    numel: collections.Counter = collections.Counter()
    rows: collections.Counter = collections.Counter()
    queue = _capture.recorder.Recorder.queue

    def spy(self, t, meta):  # type: ignore[no-untyped-def]
        key = (meta.role, self.types.get(meta.owner or meta.module, "-"))
        numel[key] += t.numel()
        rows[key] += 1
        return queue(self, t, meta)

    _capture.recorder.Recorder.queue = spy  # type: ignore[method-assign]
    try:
        with nanhunt.watch(w.model, w.optimizer, w.scaler):
            w.step()
    finally:
        _capture.recorder.Recorder.queue = queue  # type: ignore[method-assign]
    return [(role, typ, rows[(role, typ)], n) for (role, typ), n in numel.most_common()]


def rss_peaks(w: overhead.Workload, repeats: int) -> dict[str, float] | None:
    """Peak resident MiB above the start of 2 steps: plain, nanhunt, keep_tensors=False."""
    if not overhead._reset_rss_peak():
        return None

    def hunted(**options: object) -> Callable[[], None]:
        def run() -> None:
            with nanhunt.watch(w.model, w.optimizer, w.scaler, **options):
                w.step()
                w.step()

        return run

    def plain() -> None:
        w.step()
        w.step()

    configs: dict[str, Callable[[], None]] = {
        "plain": plain,
        "nanhunt": hunted(),
        "nanhunt, keep_tensors=False": hunted(keep_tensors=False),
    }
    peaks: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(repeats):
        for name, run in configs.items():
            gc.collect()
            overhead._reset_rss_peak()
            before = overhead._proc_kib("VmRSS") or 0
            run()
            peaks[name].append(((overhead._proc_kib("VmHWM") or 0) - before) / 1024)
    return {k: statistics.median(v) for k, v in peaks.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=overhead.MODELS, default="transformer")
    p.add_argument("--precision", choices=overhead.PRECISIONS, default="fp32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size", choices=tuple(overhead.SHAPES), default="full")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"prototypes match nanhunt.stats.summarize on {check_prototypes()} tensors")
    w = overhead.Workload(args.model, args.precision, overhead.SHAPES[args.size],
                          torch.device("cpu"))  # fmt: skip
    w.step()

    times = time_configs(w, args.repeats)
    plain = statistics.median(times["plain"])
    print(f"\n{args.model} {args.precision}, CPU ms per step (median), 1 torch thread")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:40s} {m * 1e3:8.1f} ms  {m / plain:5.2f}x  {(m - plain) * 1e3:+8.1f} ms")

    peaks = rss_peaks(w, args.repeats)
    if peaks is not None:
        print("\npeak resident memory above the start of 2 steps (median MiB)")
        for name, mib in peaks.items():
            print(f"{name:40s} {mib:8.0f} MiB  {mib - peaks['plain']:+6.0f} MiB")

    table = rows_by_role(w)
    total = sum(n for *_, n in table)
    print(f"\nsummarised per traced step: {sum(r for _, _, r, _ in table)} rows, "
          f"{total / 1e6:.1f}M elements")  # fmt: skip
    for role, typ, r, n in table:
        print(f"  {role:12s} {typ:32s} {r:4d} rows {n / 1e6:7.2f}M  {100 * n / total:5.1f}%")

    zero_row = torch.zeros(_stats.ROW_LEN, dtype=torch.float64)
    _stats.summarize = lambda t, fmt: zero_row
    profiler = cProfile.Profile()
    try:
        with nanhunt.watch(w.model, w.optimizer, w.scaler):
            w.step()
            profiler.enable()
            for _ in range(3):
                w.step()
            profiler.disable()
    finally:
        _stats.summarize = _stats.summarize
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
    stats.print_stats(r"nanhunt", 15)
    print("\nnanhunt's Python side, summarize stubbed, 3 traced steps (cProfile, cumulative):")
    print(text.getvalue().split("\n\n", 1)[-1].rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
