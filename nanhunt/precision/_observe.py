"""The audit's module-call observer: global forward hooks that record or measure each call.

Phases: ``record`` (the user's own step: top-level module calls go on the tape), ``target``
(a replay in the target format: each call's output is kept and the module is replayed alone in
float32 on float32 copies of the same inputs), ``float32`` (a float32 replay: outputs kept),
``off`` (nothing; our own replays run in it).

What it shares with capture (``nanhunt/capture``): module names come from capture's
:class:`~nanhunt.capture.naming.Naming` (the names ``nanhunt diagnose`` gives the same run,
DDP wrappers unwrapped), and the record phase skips what capture's module observer skips
(``_in_backward``: activation-checkpoint recomputes; ``_skip``: Dynamo tracing). Why it is not
capture's :class:`~nanhunt.capture.modules.ModuleObserver` composed differently:

- that observer is a ``Part`` of a capture ``Session``: it files each call into the session's
  step state and queues on-device *summaries* of its tensors in the recorder; the audit needs
  each call's whole output tensors, keyed by (module, call index), in replays the audit itself
  runs, to compare two replays element by element;
- in a target replay these hooks *change* a call: they return new arguments and outputs (FP8
  rounding around GEMMs, the float32 region of the advice being checked, the cast back to a
  half model's dtype) and replay the module alone in float32 from inside its post-hook;
  capture's observers must never change a value (the run stays bit-identical);
- in the user's own step the audit records only the top-level calls (a tape), not every call.

So the two would share only ``register_module_forward_pre_hook`` / ``register_module_forward_hook``;
a framework callback with ``audit=`` runs both at once, the Hunt paused while the audit replays.
"""

from __future__ import annotations

import contextlib
import math
import types
import typing
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.modules import module as _M
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from nanhunt.capture._util import _in_backward, _skip
from nanhunt.capture.compiled import compiled_boundary, global_forward_hook
from nanhunt.formats import NumberFormat
from nanhunt.precision._state import ModuleState, rebind
from nanhunt.precision._tape import autocast_pinned, cast_floating, rng_state, set_rng_state

__all__ = ["Observer", "Plan", "energies", "round_to"]

Key = tuple[str, int]
_KINDS = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


@dataclass
class Plan:
    """How a target-side replay runs."""

    fmt: NumberFormat
    measured: bool  # the run itself computed in this format
    description: str
    param_dtype: torch.dtype | None = None  # cast floating parameters (None: keep them)
    input_from: torch.dtype | None = None  # batch tensors of this dtype ...
    input_to: torch.dtype | None = None  # ... are cast to this one
    autocast_dtype: torch.dtype | None = None  # autocast on with this dtype for every call
    fp8: torch.dtype | None = None  # round GEMM inputs, weights, outputs through this format
    fix: tuple[str, ...] = ()  # modules run in float32 (the recommendation being checked)
    cast_to: torch.dtype | None = None  # what a float32 module's output is cast back to


def energies(ref: torch.Tensor, approx: torch.Tensor) -> tuple[float, float, int]:
    """(sum ref^2, sum (approx - ref)^2, non-finite count) over elements finite in both."""
    r, a = ref.detach().double(), approx.detach().double()
    if r.shape != a.shape:
        return 0.0, 0.0, 0
    ok = torch.isfinite(r) & torch.isfinite(a)
    bad = int(ok.numel() - ok.sum().item())
    r, a = r[ok], a[ok]
    return float((r * r).sum().item()), float(((a - r) ** 2).sum().item()), bad


def _scale_for(x: torch.Tensor, fmax: float) -> torch.Tensor:
    # per-tensor power-of-two scaling, as FP8 recipes do: amax lands just under the max
    amax = x.detach().abs().amax().float()
    finite = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(finite, amax, torch.ones_like(amax))
    return torch.where(finite, torch.exp2(torch.floor(torch.log2(fmax / safe))), 1.0)


class _Round(torch.autograd.Function):
    """Round through an FP8 format with per-tensor scaling; gradients are rounded the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dtype: torch.dtype, fmax: float) -> torch.Tensor:
        ctx.dtype, ctx.fmax = dtype, fmax
        return _round(x, dtype, fmax)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return _round(g, ctx.dtype, ctx.fmax), None, None


def _round(x: torch.Tensor, dtype: torch.dtype, fmax: float) -> torch.Tensor:
    s = _scale_for(x, fmax).to(x.dtype if x.is_floating_point() else torch.float32)
    return ((x * s).to(dtype).to(x.dtype)) / s


def round_to(tree: Any, plan: Plan) -> Any:
    assert plan.fp8 is not None
    return tree_map(
        lambda t: _Round.apply(t, plan.fp8, plan.fmt.max)
        if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def is_gemm(module: nn.Module) -> bool:
    """Modules whose own weight is a matrix or a kernel (Linear, Conv*, Bilinear ...)."""
    w = module._parameters.get("weight")
    return w is not None and w.dim() >= 2 and not isinstance(module, nn.Embedding)


def _leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0]
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _OpStats(TorchDispatchMode):
    """Numbers behind a layer's loss, from its float32 replay: how much its additions cancel
    or swamp, how long its reductions are, how large the arguments of sin/cos get."""

    _ADD = frozenset({"add", "sub", "rsub", "add_", "sub_"})
    # op -> which argument holds the reduced dimension last
    _MM: typing.ClassVar[dict[str, int]] = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1,
                                            "mv": 0, "dot": 0, "addmv": 1}
    _RED = frozenset({"sum", "mean", "nansum", "var", "std", "var_mean", "std_mean"})
    _DIM = frozenset({"cumsum", "cumprod", "_softmax", "_log_softmax", "logsumexp"})

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, float] = {}

    def _max(self, key: str, value: float) -> None:
        if math.isfinite(value) and value > self.data.get(key, -math.inf):
            self.data[key] = value

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._measure(func.overloadpacket.__name__, args, out)
        except Exception:  # the numbers are evidence, not the audit: count what was missed
            self.data["ops_unmeasured"] = self.data.get("ops_unmeasured", 0.0) + 1
        return out

    def _measure(self, name: str, args: tuple, out: Any) -> None:
        if name in self._ADD and isinstance(out, torch.Tensor) and out.is_floating_point():
            mags = [_amax(a) for a in args[:2]]
            big, small = max(mags), min(mags)
            o = out.detach().double()
            o = o[torch.isfinite(o)]  # a -inf mask added to scores is not a magnitude
            rms = o.pow(2).mean().sqrt().item() if o.numel() else 0.0
            if big > 0 and rms > 0:
                self._max("cancellation_bits", math.log2(big / rms))
            if big > 0 and small > 0:
                self._max("swamping_bits", math.log2(big / small))
            self.data["adds"] = self.data.get("adds", 0.0) + 1
        elif name in self._MM:
            a = args[self._MM[name]]
            if isinstance(a, torch.Tensor) and a.dim():
                self._max("reduction_length", float(a.shape[-1]))
        elif name == "convolution" and isinstance(args[1], torch.Tensor):
            self._max("reduction_length", float(args[1][0].numel()))
        elif name in self._RED and isinstance(args[0], torch.Tensor) and isinstance(
                out, torch.Tensor):
            self._max("reduction_length", args[0].numel() / max(out.numel(), 1))
        elif name in self._DIM and isinstance(args[0], torch.Tensor) and len(args) > 1:
            dim = args[1] if isinstance(args[1], int) else -1
            if args[0].dim():
                self._max("reduction_length", float(args[0].shape[dim]))
        elif name in ("sin", "cos") and isinstance(args[0], torch.Tensor):
            self._max("periodic_arg_max", _amax(args[0]))


def _amax(x: Any) -> float:
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point() or not x.numel():
            return 0.0
        v = x.detach().abs()
        v = v[torch.isfinite(v)]
        return float(v.max().item()) if v.numel() else 0.0
    return abs(float(x)) if isinstance(x, (int, float)) else 0.0


@dataclass
class _Frame:
    key: Key
    name: str
    args32: Any
    rng: Any
    fixed: bool
    region: contextlib.ExitStack | None = None
    state: ModuleState | None = None  # the module's state when this call began


@dataclass
class Measured:
    """What one replay saw: each call's output leaves, and (target) its own rounding."""

    outputs: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    inputs: dict[Key, list[torch.Tensor]] = field(default_factory=dict)  # as the call got them
    local: dict[Key, tuple[float, float, int]] = field(default_factory=dict)
    analysis: dict[str, dict[str, float]] = field(default_factory=dict)
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)  # type, order, depth, leaf


class Observer:
    """Global forward pre/post hooks, installed only while the audit traces."""

    def __init__(self, names: Callable[[nn.Module], str]) -> None:
        self.names = names
        self.phase = "off"
        self.depth = 0  # record phase: nesting of module calls (0 = top level)
        self.on_root: Callable[..., None] | None = None
        self._root_rng: list[Any] = []
        self._frames: list[_Frame] = []
        self._counts: Counter[str] = Counter()
        self.plan: Plan | None = None
        self.analyse = False
        self.original: dict[int, dict[str, torch.Tensor]] = {}  # id(module) -> own params
        self.seen = Measured()
        self._handles: list[Any] = []
        # autocast dtypes the user's recorded calls ran under, at any depth (accelerate wraps
        # the model's forward in autocast: the model's own call is made with autocast off)
        self.run_autocast: set[torch.dtype] = set()

    def install(self) -> None:
        if not self._handles:
            with contextlib.ExitStack() as stack:
                stack.enter_context(_M.register_module_forward_pre_hook(self._pre))
                stack.enter_context(global_forward_hook(self._post))
                # the user's compiled module runs without these hooks inside, recorded at its
                # boundary (the replays run it eagerly: compiled_run_eagerly)
                stack.enter_context(compiled_boundary(
                    lambda m, a: self._pre(m, a),
                    lambda m, a, k, o: self._post(m, a, k, o), set(),
                    types.SimpleNamespace(names={})))
                self._stack = stack.pop_all()
            self._handles = [self._stack]

    def remove(self) -> None:
        for h in self._handles:
            h.close()
        self._handles = []

    def begin(self, phase: str, plan: Plan | None = None, *, analyse: bool = False) -> None:
        self.phase, self.plan, self.analyse = phase, plan, analyse
        self._frames, self._counts, self.seen = [], Counter(), Measured()

    def end(self) -> Measured:
        seen, self.seen = self.seen, Measured()
        self.phase, self.plan, self._frames = "off", None, []
        return seen

    # -- hooks --------------------------------------------------------------------------

    def _pre(self, module: nn.Module, args: tuple) -> Any:
        if self.phase == "record":
            if _in_backward() or _skip():
                return None  # an activation-checkpoint recompute, a Dynamo trace: not calls
            for kind in _KINDS:  # inside the model too: a forward may enter autocast itself
                if torch.is_autocast_enabled(kind):
                    self.run_autocast.add(torch.get_autocast_dtype(kind))
            if self.depth == 0:
                # where the call starts from: replays start from there too
                self._root_rng.append((rng_state(), ModuleState.capture(module)))
            self.depth += 1
            return None
        if self.phase not in ("target", "float32"):
            return None
        name = self.names(module)
        key = (name, self._counts[name])
        self._counts[name] += 1
        if name not in self.seen.meta:
            self.seen.meta[name] = {"type": type(module).__name__, "order": len(self.seen.meta),
                                    "depth": len(self._frames),
                                    "parent": self._frames[-1].name if self._frames else None,
                                    "leaf": next(module.children(), None) is None}
        self.seen.inputs[key] = _leaves(args)  # before any change below: what the call got
        if self.phase == "float32":
            self._frames.append(_Frame(key, name, None, None, False))
            return None
        plan = self.plan
        assert plan is not None
        parent_fixed = bool(self._frames) and self._frames[-1].fixed
        fixed = parent_fixed or name in plan.fix
        frame = _Frame(key, name, cast_floating(args, torch.float32, copy=True),
                       rng_state(), fixed, state=ModuleState.capture(module))
        self._frames.append(frame)
        if fixed and not parent_fixed:
            # the recommendation as the snippet installs it: float32 inputs, autocast off
            frame.region = contextlib.ExitStack()
            for kind in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                frame.region.enter_context(torch.autocast(device_type=kind, enabled=False))
            return cast_floating(args, torch.float32)
        if plan.fp8 is not None and not fixed and is_gemm(module):
            return round_to(args, plan)
        return None

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        if self.phase == "record":
            if _in_backward() or _skip():
                return None
            self.depth = max(self.depth - 1, 0)
            if self.depth == 0 and self.on_root is not None:
                rng, state = self._root_rng.pop() if self._root_rng else (None, None)
                self.on_root(module, args, kwargs, out, rng, state)
            return None
        if self.phase not in ("target", "float32") or not self._frames:
            return None
        frame = self._frames.pop()
        new_out = None
        if self.phase == "target":
            plan = self.plan
            assert plan is not None
            if frame.region is not None:
                frame.region.close()
                if plan.cast_to is not None:
                    new_out = out = cast_floating(out, plan.cast_to)
            elif plan.fp8 is not None and not frame.fixed and is_gemm(module):
                new_out = out = round_to(out, plan)
        self.seen.outputs[frame.key] = _leaves(out)
        if self.phase == "target":
            self.seen.meta[frame.name].setdefault(
                "dtype", str(next(iter(_leaves(out)), torch.empty(0)).dtype).removeprefix(
                    "torch."))
            self._local(module, frame, kwargs, out)
        return new_out

    def _local(self, module: nn.Module, frame: _Frame, kwargs: dict, out: Any) -> None:
        """Replay ``module`` alone in float32 on float32 copies of its inputs."""
        phase, self.phase = self.phase, "off"
        after = rng_state()
        # the call alone starts where the call started (a counter not yet counted, a buffer
        # not yet updated); the replay it is part of goes on from where the call ended
        before = frame.state.apply() if frame.state is not None else []
        try:
            params = self._float32_params(module, frame.state)
            kw32 = cast_floating(kwargs, torch.float32, copy=True)
            analyse = self.analyse and frame.key[1] == 0 and frame.name not in self.seen.analysis
            stats = _OpStats() if analyse else contextlib.nullcontext()
            set_rng_state(frame.rng)
            with contextlib.ExitStack() as stack:
                for kind in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                    stack.enter_context(torch.autocast(device_type=kind, enabled=False))
                stack.enter_context(autocast_pinned(None))  # also where forward enters it
                stack.enter_context(torch.no_grad())
                stack.enter_context(stats)
                ref = functional_call(module, params, frame.args32, kw32, strict=False,
                                      tie_weights=False)
            sig = noise = 0.0
            bad = 0
            ref_leaves = _leaves(ref)
            for r, a in zip(ref_leaves, _leaves(out), strict=False):
                s, n, b = energies(r, a)
                sig, noise, bad = sig + s, noise + n, bad + b
            self.seen.local[frame.key] = (sig, noise, bad)
            if analyse:
                data = dict(stats.data)  # type: ignore[union-attr]
                data.update(_range(ref_leaves, self.plan.fmt))  # type: ignore[union-attr]
                self.seen.analysis[frame.name] = data
        finally:
            rebind(before)
            set_rng_state(after)
            self.phase = phase

    def _float32_params(self, module: nn.Module,
                        state: ModuleState | None) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for prefix, sub in module.named_modules(remove_duplicate=False):
            own = self.original.get(id(sub), {})
            for pname, p in own.items():
                out[f"{prefix}.{pname}" if prefix else pname] = p
            for bname, b in sub._buffers.items():
                if b is None:
                    continue
                full = f"{prefix}.{bname}" if prefix else bname
                if state is not None:  # as it was when the call began
                    b = state.buffers.get(full, b)
                # a copy of the replay's own buffer, never the user's
                out[full] = b.detach().to(
                    torch.float32 if b.is_floating_point() else b.dtype, copy=True)
        return out


def _range(leaves: list[torch.Tensor], fmt: NumberFormat) -> dict[str, float]:
    """Where a layer's float32 values sit against the format's range."""
    n = below = above = 0
    lo, hi = math.inf, 0.0
    for t in leaves:
        v = t.detach().abs().float()
        v = v[torch.isfinite(v) & (v > 0)]
        if not v.numel():
            continue
        n += v.numel()
        below += int((v < fmt.smallest_normal).sum().item())
        above += int((v > fmt.max).sum().item())
        lo, hi = min(lo, float(v.min().item())), max(hi, float(v.max().item()))
    if not n:
        return {}
    return {"below_normal_fraction": below / n, "above_max_fraction": above / n,
            "dynamic_range_binades": math.log2(hi / lo) if lo > 0 else 0.0}
