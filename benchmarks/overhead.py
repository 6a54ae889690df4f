"""How much a training step slows down under nanhunt, against plain and the usual alternatives.

Run from the repository root::

    python benchmarks/overhead.py                  # default CPU plan, 2-3 minutes on 2 cores
    python benchmarks/overhead.py --device cuda    # every model in fp32 and fp16
    python benchmarks/overhead.py --quick --json q.json

Everything runs in one process. For each model and precision the variants take turns: each
round runs one block of ``--steps`` timed steps of every variant (the order rotates between
rounds), so drift in the machine's load reaches every variant alike. The variants:

``plain``            the step alone
``nanhunt``          one :class:`nanhunt.Hunt` per block, full per-layer statistics every step
``nanhunt-sampled``  the same with ``sample_every=N`` (``--sample-every``, default 10)
``sentinel``         one :func:`nanhunt.sentinel` per block: cheap checks every step, a replay
                     with full tracing only when a step fails (none does here)
``detect_anomaly``   ``torch.autograd.detect_anomaly(check_nan=True)`` around the block
``naive``            a global forward hook calling ``out.isfinite().all().item()`` per module

A step is forward, loss, backward and optimizer step, under ``torch.autocast`` and with a
``torch.amp.GradScaler`` in fp16. ``docs/performance.md`` says how to read the output.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.nn.modules import module as _M

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import nanhunt

SCHEMA_VERSION = 1
VARIANTS = ("plain", "nanhunt", "nanhunt-sampled", "sentinel", "detect_anomaly", "naive")
MODELS = ("mlp", "transformer", "cnn")
PRECISIONS = ("fp32", "fp16")
# On a CPU, fp16 matrix products are emulated (about 50x slower than fp32 here), so fp16 runs
# measure the emulation, not nanhunt, and a full grid would take an hour: the default CPU plan
# keeps one fp16 model to exercise the GradScaler path.
CPU_PLAN = (("mlp", "fp32"), ("transformer", "fp32"), ("cnn", "fp32"), ("mlp", "fp16"))


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Shape:
    """Sizes of the three models; ``tiny`` keeps the same module graph, for smoke runs."""

    mlp_width: int
    mlp_batch: int
    d_model: int
    ffn: int
    seq: int
    tf_batch: int
    vocab: int
    cnn_channels: int
    cnn_batch: int


SHAPES = {
    "full": Shape(
        mlp_width=1024,
        mlp_batch=64,
        d_model=256,
        ffn=1024,
        seq=128,
        tf_batch=16,
        vocab=1024,
        cnn_channels=32,
        cnn_batch=32,
    ),
    "tiny": Shape(
        mlp_width=64,
        mlp_batch=8,
        d_model=32,
        ffn=64,
        seq=8,
        tf_batch=2,
        vocab=64,
        cnn_channels=4,
        cnn_batch=2,
    ),
}


def build_mlp(s: Shape) -> nn.Module:
    w = s.mlp_width
    return nn.Sequential(
        nn.Linear(w, w),
        nn.ReLU(),
        nn.Linear(w, w),
        nn.ReLU(),
        nn.Linear(w, w),
        nn.ReLU(),
        nn.Linear(w, 10),
    )


def build_transformer(s: Shape) -> nn.Module:
    # batch_first, post-norm, no nested tensors: in training mode with grad enabled torch takes
    # the same (non-fused) path in every variant; _check_same_path asserts the preconditions.
    layer = nn.TransformerEncoderLayer(
        s.d_model,
        nhead=4,
        dim_feedforward=s.ffn,
        dropout=0.1,
        batch_first=True,
        norm_first=False,
    )
    return nn.Sequential(
        nn.Embedding(s.vocab, s.d_model),
        nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False),
        nn.Linear(s.d_model, s.vocab),
    )


def build_cnn(s: Shape) -> nn.Module:
    c = s.cnn_channels

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, c),
        *block(c, c),
        nn.MaxPool2d(2),
        *block(c, 2 * c),
        *block(2 * c, 2 * c),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * c * 8 * 8, 10),
    )


def make_batch(name: str, s: Shape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        x = torch.randn(s.mlp_batch, s.mlp_width, generator=g)
        y = torch.randint(0, 10, (s.mlp_batch,), generator=g)
    elif name == "transformer":
        x = torch.randint(0, s.vocab, (s.tf_batch, s.seq), generator=g)
        y = torch.randint(0, s.vocab, (s.tf_batch, s.seq), generator=g)
    else:
        x = torch.randn(s.cnn_batch, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (s.cnn_batch,), generator=g)
    return x.to(device), y.to(device)


BUILDERS: dict[str, Callable[[Shape], nn.Module]] = {
    "mlp": build_mlp,
    "transformer": build_transformer,
    "cnn": build_cnn,
}


class Workload:
    """One model, its optimizer and scaler, and one training step on a fixed batch."""

    def __init__(self, name: str, precision: str, shape: Shape, device: torch.device) -> None:
        torch.manual_seed(0)
        self.name, self.precision, self.device = name, precision, device
        self.model = BUILDERS[name](shape).to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.fp16 = precision == "fp16"
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.fp16)
        self.x, self.y = make_batch(name, shape, device)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.fp16):
            out = self.model(self.x)
            loss = F.cross_entropy(out.float().flatten(0, -2), self.y.flatten())
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()


def _check_same_path(w: Workload) -> None:
    """The fused TransformerEncoderLayer fast path runs only in eval or without grad."""
    assert w.model.training
    assert torch.is_grad_enabled()
    assert all(p.requires_grad for p in w.model.parameters())


# ----------------------------------------------------------------------------- variants


def _naive_check(module: nn.Module, args: Any, output: Any) -> None:
    outs = output if isinstance(output, (tuple, list)) else (output,)
    for t in outs:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.isfinite().all().item():
            raise RuntimeError(f"non-finite output in {type(module).__name__}")


@contextlib.contextmanager
def variant_context(name: str, w: Workload, sample_every: int) -> Iterator[Any]:
    """Install the variant around a block of steps; yields the Hunt, if any."""
    if name == "plain":
        yield None
    elif name in ("nanhunt", "nanhunt-sampled"):
        every = 1 if name == "nanhunt" else sample_every
        with nanhunt.watch(
            w.model, w.optimizer, w.scaler, target="float16", sample_every=every
        ) as hunt:
            yield hunt
    elif name == "sentinel":
        with nanhunt.sentinel(w.model, w.optimizer, w.scaler, out=None) as sentinel:
            yield sentinel
    elif name == "detect_anomaly":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
            with torch.autograd.detect_anomaly(check_nan=True):
                yield None
    elif name == "naive":
        with _M.register_module_forward_hook(_naive_check):
            yield None
    else:
        raise SystemExit(f"overhead: unknown variant {name}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Samples:
    """Per-step times of one variant; ``full`` marks sampled mode's traced steps.

    ``wall`` is perf_counter time. ``cpu`` is this process's CPU time: with one torch thread
    the whole CPU step runs on the calling thread, so it leaves out the time the scheduler
    gave to other processes on a shared machine.
    """

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    full: list[bool] = field(default_factory=list)
    failures: int = 0


def run_block(w: Workload, variant: str, steps: int, sample_every: int, out: Samples) -> None:
    with variant_context(variant, w, sample_every) as hunt:
        for _ in range(steps):
            full = isinstance(hunt, nanhunt.Hunt) and hunt.step % hunt.sample_every == 0
            _sync(w.device)
            t0, c0 = time.perf_counter(), time.process_time()
            w.step()
            _sync(w.device)
            out.wall.append(time.perf_counter() - t0)
            out.cpu.append(time.process_time() - c0)
            out.full.append(full)
    if hunt is not None and hunt.first_failure is not None:
        out.failures += 1


# ----------------------------------------------------------------------------- statistics


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def _median_and_spread(
    times: list[float], full: list[bool], sample_every: int, sampled: bool
) -> tuple[float, float, float, float]:
    """(median, p25, p75, IQR / median); sampled mode amortises one traced and N-1 cheap steps.

    A plain median of sampled mode's steps would report only the cheap ones, so its median
    combines the two medians, (full + (N - 1) * cheap) / N, and its quartiles are the cheap
    steps'.
    """
    traced = [t for t, f in zip(times, full) if f]
    cheap = [t for t, f in zip(times, full) if not f]
    if sampled and traced and cheap:
        q1, med_cheap, q3 = quartiles(cheap)
        median = (statistics.median(traced) + (sample_every - 1) * med_cheap) / sample_every
        return median, q1, q3, (q3 - q1) / med_cheap
    q1, median, q3 = quartiles(times)
    return median, q1, q3, (q3 - q1) / median


def summarize(variant: str, s: Samples, sample_every: int) -> dict[str, Any]:
    sampled = variant == "nanhunt-sampled"
    median, q1, q3, spread = _median_and_spread(s.wall, s.full, sample_every, sampled)
    cpu_median, _, _, cpu_spread = _median_and_spread(s.cpu, s.full, sample_every, sampled)
    row: dict[str, Any] = {
        "variant": variant,
        "n_steps": len(s.wall),
        "median_ms": median * 1e3,
        "p25_ms": q1 * 1e3,
        "p75_ms": q3 * 1e3,
        "iqr_rel": spread,
        "cpu_median_ms": cpu_median * 1e3,
        "cpu_iqr_rel": cpu_spread,
    }
    if sampled:
        row["traced_step_ms"] = (
            statistics.median([t for t, f in zip(s.wall, s.full) if f] or s.wall) * 1e3
        )
        row["cheap_step_ms"] = (
            statistics.median([t for t, f in zip(s.wall, s.full) if not f] or s.wall) * 1e3
        )
    row["step_ms"] = [round(t * 1e3, 3) for t in s.wall]
    row["step_cpu_ms"] = [round(t * 1e3, 3) for t in s.cpu]
    row["failures"] = s.failures
    return row


# ----------------------------------------------------------------------------- memory


def _traced_peak(fn: Callable[[], None]) -> int:
    """Peak bytes Python and numpy allocate during ``fn`` above what was live before it.

    torch's CPU tensors bypass Python's allocator, so this is nanhunt's host bookkeeping
    (records, numpy rows, dicts), not activations.
    """
    gc.collect()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    fn()
    return tracemalloc.get_traced_memory()[1] - base


def _proc_kib(key: str) -> int | None:
    with contextlib.suppress(OSError, AttributeError, ValueError):
        text = Path("/proc/self/status").read_text()
        line = next(x for x in text.splitlines() if x.startswith(key + ":"))
        return int(line.split()[1])
    return None


def _reset_rss_peak() -> bool:
    """Linux resets the peak resident size (VmHWM) when "5" is written to clear_refs."""
    # hand freed heap back to the OS first, or a block reuses what the last one freed
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _proc_kib("VmHWM") is not None


def measure_memory(w: Workload, steps: int, sample_every: int) -> dict[str, Any]:
    """Peak memory of a block of plain steps against a block under nanhunt.

    Three views: tracemalloc (Python and numpy only: nanhunt's records), the process's peak
    resident size (everything on the host, torch's CPU tensors included; Linux only) and, on
    CUDA, torch's peak allocated device memory.
    """
    out: dict[str, Any] = {"model": w.name, "precision": w.precision, "steps": steps}
    cuda = w.device.type == "cuda"
    for variant in ("plain", "nanhunt"):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(w.device)
            before = torch.cuda.memory_allocated(w.device)
        gc.collect()
        rss = _reset_rss_peak()
        rss_before = _proc_kib("VmRSS") if rss else None
        out[f"{variant}_host_peak_bytes"] = _traced_peak(
            lambda v=variant: run_block(w, v, steps, sample_every, Samples())
        )
        if rss_before is not None:
            out[f"{variant}_rss_peak_bytes"] = ((_proc_kib("VmHWM") or 0) - rss_before) * 1024
        if cuda:
            out[f"{variant}_cuda_peak_bytes"] = torch.cuda.max_memory_allocated(w.device) - before
    for view in ("host", "rss", "cuda"):
        if f"nanhunt_{view}_peak_bytes" in out:
            out[f"nanhunt_{view}_extra_bytes"] = (
                out[f"nanhunt_{view}_peak_bytes"] - out[f"plain_{view}_peak_bytes"]
            )
    return out


def _hunt_buffers(hunt: nanhunt.Hunt) -> dict[str, int]:
    layers = hunt.layers
    return {
        "ring_steps": len(hunt.recorder.ring),
        "keep_steps": hunt.keep_steps,
        "step_records": len(hunt.steps),
        "layers": len(layers),
        "per_layer_by_step_entries": sum(
            len(x.forward_amax_by_step) + len(x.backward_amax_by_step) + len(x.param_amax_by_step)
            for x in layers
        ),
    }


def measure_growth(device: torch.device, checkpoints: tuple[int, ...]) -> dict[str, Any]:
    """Bytes a live Hunt holds after 50, 100, 200... steps of one run (tiny transformer).

    What a Hunt retains depends on the number of modules and steps, not on tensor sizes, so the
    tiny shape with the transformer's module graph is used: hundreds of steps stay cheap. A
    bounded Hunt stops growing once its ring buffer (``keep_steps``) is full.
    """
    w = Workload("transformer", "fp32", SHAPES["tiny"], device)
    w.step()
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    runs = []
    with nanhunt.watch(w.model, w.optimizer, w.scaler, target="float16") as hunt:
        for n in range(1, max(checkpoints) + 1):
            w.step()
            if n in checkpoints:
                gc.collect()
                retained = tracemalloc.get_traced_memory()[0] - base
                runs.append({"steps": n, "retained_bytes": retained, **_hunt_buffers(hunt)})
    a, b = runs[-2] if len(runs) > 1 else runs[0], runs[-1]
    per_step = (b["retained_bytes"] - a["retained_bytes"]) / max(b["steps"] - a["steps"], 1)
    return {
        "model": "transformer (tiny shape)",
        "runs": runs,
        "bytes_per_extra_step": per_step,
        "slope_between": [a["steps"], b["steps"]],
    }


def count_syncs(w: Workload, variant: str, steps: int, sample_every: int) -> float:
    """Device-to-host synchronisations per step that torch's sync debug mode reports."""
    run_block(w, variant, 1, sample_every, Samples())  # lazy init outside the count
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_block(w, variant, steps, sample_every, Samples())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [c for c in caught if "synchroniz" in str(c.message)]
    return len(syncs) / steps


# ----------------------------------------------------------------------------- machine


def machine_facts(device: torch.device) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    facts: dict[str, Any] = {
        "cpu_model": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "nanhunt_version": nanhunt.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": cpu,
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    root = Path(__file__).resolve().parents[1]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "-C", str(root)]
        facts["git_commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "nanhunt"], capture_output=True, text=True
        ).stdout
        facts["nanhunt_dirty"] = bool(dirty.strip())  # uncommitted edits under nanhunt/
    if device.type == "cuda":
        facts["device_name"] = torch.cuda.get_device_name(device)
        facts["cuda_version"] = torch.version.cuda
    return facts


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, help="timed steps per block (default: 3 cpu, 20 cuda)")
    p.add_argument("--repeats", type=int, help="blocks per variant (default: 3 cpu, 5 cuda)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    p.add_argument("--models", help=f"comma-separated, from {','.join(MODELS)}")
    p.add_argument("--precisions", help=f"comma-separated, from {','.join(PRECISIONS)}")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--sample-every", type=int, default=10)
    p.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: 1 on cpu, for stable timings on a shared box)",
    )
    p.add_argument("--size", choices=tuple(SHAPES), help="model sizes (default: full)")
    p.add_argument(
        "--growth-steps",
        default="50,100,200",
        help="checkpoints (steps) of the retained-memory run",
    )
    p.add_argument("--memory-steps", type=int, default=2)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: tiny shapes, few steps, short growth check"
    )
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if args.quick:
        args.size = args.size or "tiny"
        args.steps = args.steps or 2
        args.repeats = args.repeats or 1
        args.warmup = min(args.warmup, 1)
        args.growth_steps = "5,10"
        args.memory_steps = 2
    args.size = args.size or "full"
    args.steps = args.steps or (20 if cuda else 3)
    args.repeats = args.repeats or (5 if cuda else 3)
    if args.models or args.precisions or cuda:
        models = (args.models or ",".join(MODELS)).split(",")
        precisions = (args.precisions or ",".join(PRECISIONS)).split(",")
        args.plan = [(m, p) for m in models for p in precisions]
    else:
        args.plan = list(CPU_PLAN)
    args.variants = args.variants.split(",")
    for m, prec in args.plan:
        if m not in MODELS or prec not in PRECISIONS:
            p.error(f"unknown model or precision: {m} {prec}")
    if "plain" not in args.variants:
        p.error("the variants must include plain (ratios are to plain)")
    if args.steps < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be at least 1")
    args.growth_steps = tuple(int(n) for n in args.growth_steps.split(","))
    return args


def render(
    rows: list[dict[str, Any]],
    memory: list[dict[str, Any]],
    growth: dict[str, Any],
    syncs: list[dict[str, Any]],
    console: Console,
) -> None:
    cpu = any(r.get("cpu_ratio") is not None for r in rows)
    table = Table(title="Training-step time: median per step, ratio to plain")
    cols = [
        ("model", "left"),
        ("prec", "left"),
        ("variant", "left"),
        ("wall ms", "right"),
        ("ratio", "right"),
        ("±IQR/2", "right"),
    ]
    if cpu:
        cols.append(("cpu ratio", "right"))
    for col, just in cols:
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    last = None
    for r in rows:
        key = (r["model"], r["precision"])
        if last is not None and key != last:
            table.add_section()
        last = key
        cells = [
            r["model"],
            r["precision"],
            r["variant"],
            f"{r['median_ms']:.1f}",
            f"{r['ratio']:.2f}x",
            f"±{50 * r['iqr_rel']:.0f}%",
        ]
        if cpu:
            cells.append(f"{r['cpu_ratio']:.2f}x")
        table.add_row(*cells)
    console.print(table)

    mem = Table(title="Extra peak memory under nanhunt (vs plain)")
    views = [
        (view, title)
        for view, title in (
            ("host", "python+numpy"),
            ("rss", "host RSS"),
            ("cuda", "cuda allocated"),
        )
        if any(f"nanhunt_{view}_extra_bytes" in m for m in memory)
    ]
    for col in ("model", "prec", *(title for _, title in views)):
        mem.add_column(col, justify="left" if col in ("model", "prec") else "right")
    for m in memory:
        cells = [m["model"], m["precision"]]
        cells += [_mib(m[f"nanhunt_{view}_extra_bytes"]) for view, _ in views]
        mem.add_row(*cells)
    console.print(mem)

    gr = Table(title=f"Held by a live Hunt, {growth['model']}")
    for col in ("steps", "retained", "ring", "records", "by-step entries"):
        gr.add_column(col, justify="right")
    for run in growth["runs"]:
        gr.add_row(
            str(run["steps"]),
            _mib(run["retained_bytes"]),
            f"{run['ring_steps']}/{run['keep_steps']}",
            str(run["step_records"]),
            str(run["per_layer_by_step_entries"]),
        )
    console.print(gr)
    a, b = growth["slope_between"]
    console.print(
        f"growth from step {a} to {b}: {growth['bytes_per_extra_step'] / 1024:.1f} KiB per step"
    )

    if syncs:
        st = Table(title="Device-to-host synchronisations per step (sync debug mode)")
        for col in ("model", "prec", "variant", "syncs/step"):
            st.add_column(col)
        for s in syncs:
            st.add_row(s["model"], s["precision"], s["variant"], f"{s['syncs_per_step']:.2f}")
        console.print(st)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("overhead: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    shape = SHAPES[args.size]
    console = Console(stderr=False)
    facts = machine_facts(device)
    started = time.perf_counter()

    rows: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    syncs: list[dict[str, Any]] = []
    for model, precision in args.plan:
        w = Workload(model, precision, shape, device)
        _check_same_path(w)
        samples = {v: Samples() for v in args.variants}
        for v in args.variants:
            run_block(w, v, args.warmup, args.sample_every, Samples())
        for r in range(args.repeats):
            # rotate the order each round, so no variant always follows the same one
            order = (
                args.variants[r % len(args.variants) :] + args.variants[: r % len(args.variants)]
            )
            for v in order:
                run_block(w, v, args.steps, args.sample_every, samples[v])
        summaries = [summarize(v, samples[v], args.sample_every) for v in args.variants]
        plain = next(s for s in summaries if s["variant"] == "plain")
        for s in summaries:
            s["ratio"] = s["median_ms"] / plain["median_ms"]
            # CPU time says nothing about a GPU's share of the step
            s["cpu_ratio"] = (
                s["cpu_median_ms"] / plain["cpu_median_ms"] if device.type == "cpu" else None
            )
            rows.append({"model": model, "precision": precision, **s})
        console.print(
            f"[dim]{model} {precision}: done at {time.perf_counter() - started:.0f} s[/dim]"
        )
        if device.type == "cuda":
            for v in ("plain", "nanhunt", "nanhunt-sampled", "sentinel"):
                n = max(args.sample_every, args.steps)
                syncs.append(
                    {
                        "model": model,
                        "precision": precision,
                        "variant": v,
                        "syncs_per_step": count_syncs(w, v, n, args.sample_every),
                    }
                )
        del w
        gc.collect()

    facts["timing_s"] = round(time.perf_counter() - started, 1)
    tracemalloc.start()
    try:
        for model, precision in args.plan:
            w = Workload(model, precision, shape, device)
            run_block(w, "nanhunt", 1, args.sample_every, Samples())
            memory.append(measure_memory(w, args.memory_steps, args.sample_every))
            del w
        facts["memory_s"] = round(time.perf_counter() - started - facts["timing_s"], 1)
        growth = measure_growth(device, args.growth_steps)
    finally:
        tracemalloc.stop()

    if hasattr(os, "getloadavg"):
        facts["loadavg_end"] = list(os.getloadavg())
    facts["wall_s"] = round(time.perf_counter() - started, 1)
    render(rows, memory, growth, syncs, console)
    console.print(
        f"[dim]{facts['cpu_model']}, {facts['torch_threads']} torch thread(s), "
        f"torch {facts['torch_version']}, {facts['wall_s']} s[/dim]"
    )
    if args.json:
        doc = {
            "schema_version": SCHEMA_VERSION,
            "command": " ".join(["python", "benchmarks/overhead.py", *(argv or sys.argv[1:])]),
            "machine": facts,
            "config": {
                "device": args.device,
                "steps": args.steps,
                "repeats": args.repeats,
                "warmup": args.warmup,
                "sample_every": args.sample_every,
                "size": args.size,
                "plan": args.plan,
                "variants": args.variants,
                "memory_steps": args.memory_steps,
            },
            "results": rows,
            "memory": memory,
            "growth": growth,
            "syncs": syncs,
        }
        args.json.write_text(json.dumps(_finite(doc), indent=2, allow_nan=False) + "\n")
    return 0


def _finite(obj: Any) -> Any:
    """Non-finite floats as the strings "nan", "inf", "-inf" (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
