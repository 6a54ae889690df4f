"""The live session: hooks that see a training step's tensors, and the per-step recorder.

Data flows one way: hooks summarise tensors on their own device (:mod:`nanhunt.stats`) and queue
the rows; once per step the queued rows cross to the host in one transfer; the host side turns
them into records, per-module ranges and step records, and asks :mod:`nanhunt.locate` for the
origin when a step has a problem.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import functools
import inspect
import math
import sys
import threading
import traceback
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules import module as _M
from torch.optim import optimizer as _O
from torch.utils.weak import WeakIdKeyDictionary

from . import stats as _stats
from .errors import NanhuntError
from .formats import NumberFormat, get_format
from .locate import Rec, find_origin
from .trace import (
    Failure,
    LayerStats,
    RunInfo,
    ScalerEvent,
    StepRecord,
    TensorRecord,
    TensorStats,
    Trace,
)

__all__ = ["Hunt", "StopRun", "watch"]

_LOCK = threading.Lock()
_ACTIVE: Hunt | None = None


class StopRun(BaseException):
    """Raised out of a training step to stop the script once the failing step is captured."""


# ----------------------------------------------------------------------------- small helpers


def _safe(method: Any) -> Any:
    """A hook method whose exceptions (bugs of ours) stop tracing but never the user's run;
    StopRun, a BaseException, passes."""

    @functools.wraps(method)
    def hook(self: Hunt, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            self._internal_failure(exc)
            return None

    return hook


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


try:
    _compiling = torch.compiler.is_compiling
except AttributeError:  # torch < 2.3
    _compiling = torch._dynamo.is_compiling


def _skip() -> bool:
    """Hooks do nothing while Dynamo traces a compiled region (its kernels are not
    observable from Python; the hooks must not become part of the graph)."""
    return _compiling()


def _version(t: torch.Tensor) -> int:
    """In-place edit counter; inference tensors (``torch.inference_mode``) have none."""
    return -1 if t.is_inference() else t._version


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    if device_type not in ("cpu", "cuda", "xpu", "hpu", "mps", "xla"):
        return False, None  # meta and other pseudo-devices have no autocast
    try:
        if not torch.is_autocast_enabled(device_type):
            return False, None
        return True, torch.get_autocast_dtype(device_type)
    except TypeError:  # torch < 2.4 has per-device functions
        if device_type == "cpu":
            enabled = torch.is_autocast_cpu_enabled()
            return enabled, torch.get_autocast_cpu_dtype() if enabled else None
        enabled = torch.is_autocast_enabled()
        return enabled, torch.get_autocast_gpu_dtype() if enabled else None


def tensor_leaves(obj: Any, path: str, out: list[tuple[str, torch.Tensor]], depth: int = 0) -> None:
    """Tensors nested in tuples, lists, dicts, named tuples and dataclasses, with their paths."""
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    elif isinstance(obj, dict):
        for k, v in obj.items():
            tensor_leaves(v, f"{path}[{k!r}]", out, depth + 1)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for name in obj._fields:
            tensor_leaves(getattr(obj, name), f"{path}.{name}", out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            tensor_leaves(v, f"{path}[{i}]", out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            tensor_leaves(getattr(obj, f.name, None), f"{path}.{f.name}", out, depth + 1)


def map_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` with each tensor replaced by ``fn(tensor)``, through the same containers as
    :func:`tensor_leaves` (tuples, lists, dicts, named tuples)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def _leaves(obj: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):  # the common case, without the walk
        return [(path, obj)]
    out: list[tuple[str, torch.Tensor]] = []
    tensor_leaves(obj, path, out)
    return out


_DROPOUT = (nn.modules.dropout._DropoutNd,)
_WRAPPERS = {"DistributedDataParallel": "module", "DataParallel": "module",
             "FullyShardedDataParallel": "module", "OptimizedModule": "_orig_mod"}


def _unwrap(root: nn.Module) -> nn.Module:
    while isinstance(getattr(root, _WRAPPERS.get(type(root).__name__, ""), None), nn.Module):
        root = getattr(root, _WRAPPERS[type(root).__name__])
    return root


def _foreach_norm(tensors: list[torch.Tensor], ord: float) -> tuple[torch.Tensor, ...]:
    try:
        return torch._foreach_norm(tensors, ord, dtype=torch.float32)
    except (TypeError, RuntimeError):  # older torch: no dtype argument
        return tuple(t.detach().float().norm(ord) for t in tensors)


def _call_leaves(args: Any, kwargs: dict | None) -> list[tuple[str, torch.Tensor]]:
    leaves = _leaves(args, "input")
    for k, v in (kwargs or {}).items():
        leaves.extend(_leaves(v, f"input[{k!r}]"))
    return leaves


def _variable_name(obj: object) -> str | None:
    """The name a user's variable gives ``obj``: __main__'s globals, then the calling frames."""
    main = sys.modules.get("__main__")
    for k, v in vars(main).items() if main else ():
        if v is obj and not k.startswith("_"):
            return k
    frame = sys._getframe(1)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_THIS_PACKAGE_DIR):
            for k, v in frame.f_locals.items():
                if v is obj and k != "self" and not k.startswith("_"):
                    return k
        frame = frame.f_back
    return None


_THIS_PACKAGE_DIR = __file__.rsplit("/", 1)[0]
_TORCH_DIR = torch.__file__.rsplit("/", 1)[0]


def _owner_of(module: nn.Module) -> nn.Module:
    """The largest model in the user's reach that contains ``module``: a submodule called
    through a method of its model (``vae.decode(z)`` runs ``vae.decoder``) is named inside it."""
    candidates: list[nn.Module] = []
    main = sys.modules.get("__main__")
    frame = sys._getframe(1)
    scopes = []
    while frame is not None:
        fname = frame.f_code.co_filename
        if not (fname.startswith(_THIS_PACKAGE_DIR) or fname.startswith(_TORCH_DIR)):
            scopes.append(frame.f_locals)
        frame = frame.f_back
    if main is not None:
        scopes.append(vars(main))
    seen: set[int] = {id(module)}
    for scope in scopes:
        for value in list(scope.values()):
            if isinstance(value, nn.Module) and id(value) not in seen:
                seen.add(id(value))
                candidates.append(value)
    best, size = module, 0
    for cand in candidates:
        mods = list(cand.modules())
        if len(mods) > size and any(m is module for m in mods):
            best, size = cand, len(mods)
    return best
_MAX_ANCESTOR_COPY = 20_000_000  # parameters: larger enclosing modules are not copied
_HIST_OFFSET = 320  # gradient histograms span binades -320..319 (room to unscale)
HISTORY = 10_000  # steps of timeline and per-layer history kept (memory stays bounded)


# ----------------------------------------------------------------------------- per-step state


@dataclass
class _Meta:
    """What the host knows about a queued row before its values arrive."""

    step: int
    order: int
    phase: str
    module: str  # blamed module name
    tensor: str
    role: str
    dtype: str
    shape: tuple[int, ...]
    owner: str = ""  # module whose per-layer range this row belongs to
    producer: int | None = None
    parent: int | None = None
    consumers: list[int] = field(default_factory=list)
    consumer_paths: list[str] = field(default_factory=list)
    also_producers: list[int] = field(default_factory=list)  # containers passing it through
    also_owners: list[str] = field(default_factory=list)
    mutated: bool = False
    allowed: bool = False
    approx: Any = None  # a cheap row (counts are flags): weakref to the tensor to redo exactly


@dataclass
class _Call:
    """One module call in the current step (kept to snapshot the culprit)."""

    id: int
    module: nn.Module
    name: str
    parent: int | None
    args: Any = None
    kwargs: Any = None
    autocast: tuple[bool, torch.dtype | None] = (False, None)
    output_rows: list[int] = field(default_factory=list)
    mutated_inputs: list[str] = field(default_factory=list)  # changed in place by the call


@dataclass
class _Frame:
    module: nn.Module
    name: str
    call: int
    order: int
    versions: list[tuple[torch.Tensor, int]]


@dataclass
class _StepData:
    """Decoded records of one step (kept in the ring buffer)."""

    index: int
    metas: list[_Meta] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    parents: dict[int, int | None] = field(default_factory=dict)
    loss: float | None = None
    scale: float | None = None
    scale_after: float | None = None
    found_inf: bool | None = None
    optimizer_ran: bool = False
    grad_sumsq: float | None = None
    problem: str | None = None


@dataclass
class _LayerAcc:
    module: str
    type: str
    calls: int = 0
    dtypes: set[str] = field(default_factory=set)
    forward: np.ndarray | None = None
    backward: np.ndarray | None = None
    param_grad: np.ndarray | None = None
    fwd_by_step: dict[int, float] = field(default_factory=dict)
    bwd_by_step: dict[int, float] = field(default_factory=dict)
    param_by_step: dict[int, float] = field(default_factory=dict)


def _merge_rows(acc: np.ndarray | None, row: np.ndarray) -> np.ndarray:
    if acc is None:
        return row.copy()
    out = acc + row
    out[5] = max(acc[5], row[5])  # amax
    out[6] = min(acc[6], row[6])  # amin
    return out


@dataclass
class Snapshot:
    """The culprit module with the inputs of its failing call, for replay."""

    module: nn.Module
    name: str
    args: Any
    kwargs: Any
    grad_outputs: list[torch.Tensor | None] | None
    autocast: tuple[bool, torch.dtype | None]
    phase: str
    step: int
    stale_inputs: list[str] = field(default_factory=list)
    call_site: tuple[str, int, str] | None = None  # where the parent's forward calls it
    # enclosing module calls (nearest first), to verify a fix over a region: not saved to disk
    ancestors: list[Snapshot] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # submodule path -> name in the trace


# ----------------------------------------------------------------------------- the session


class Hunt:
    """Watch training steps and find the first non-finite value, with per-layer ranges.

    Use it as a context manager around one failing step or a whole loop, or call
    :meth:`start` and :meth:`stop`::

        import torch, nanhunt
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with nanhunt.watch(model, opt) as hunt:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()
        print(hunt.first_failure)          # None: every value was finite
        print(hunt.steps[-1].loss)         # the last step's loss
        print(hunt.layers[0].module)       # per-module ranges, execution order

    Reading the result: ``first_failure`` names the step (0-based), the phase (``data``,
    ``forward``, ``backward``, ``optimizer``, ``loss_scaling``), the module's qualified name
    as in ``model.named_modules()``, the tensor (``output[0]``, ``grad_input[0]``,
    ``fc.weight.grad``, ``loss``) and the values' summary. A module is blamed only when its
    inputs were finite; a non-finite value that a later module absorbed (a ``-inf`` attention
    mask) is recorded in ``facts``, not blamed. ``layers`` gives each module's forward and
    backward magnitude ranges, to read against the target format's limits
    (``headroom`` in binades below its max). ``steps`` has one record per step, including
    the steps GradScaler skipped.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any = None,
        *,
        target: str = "float16",
        keep_steps: int = 64,
        allow_inf: Iterable[str] = (),
        sample_every: int = 1,
        keep_tensors: bool = True,
        stop_on_problem: bool = False,
        max_steps: int | None = None,
        collapse_scale: float = 1.0,
        on_step: Any = None,
    ) -> None:
        if keep_steps < 1:
            raise NanhuntError("keep_steps must be at least 1")
        if sample_every < 1:
            raise NanhuntError("sample_every must be at least 1")
        self.format: NumberFormat = get_format(target)
        self.target = self.format.name
        self.keep_steps = keep_steps
        self.allow_inf = tuple(allow_inf)
        self.sample_every = sample_every
        self.keep_tensors = keep_tensors
        self.stop_on_problem = stop_on_problem
        self.collapse_scale = collapse_scale
        self.max_steps = max_steps
        self.on_step = on_step  # called with each finished StepRecord (the CLI's live line)
        self._model_ref = weakref.ref(model) if model is not None else None
        self._optimizer_ref = weakref.ref(optimizer) if optimizer is not None else None
        self._scaler_ref = weakref.ref(scaler) if scaler is not None else None
        self._stack: contextlib.ExitStack | None = None
        self._module_handles: list[Any] = []
        self._reset()

    # -- state --------------------------------------------------------------------------

    def _reset(self) -> None:
        self.first_failure: Failure | None = None
        self.problem: str | None = None
        self.internal_errors: list[str] = []
        self.facts: list[str] = []
        self.snapshot: Snapshot | None = None
        self.failure_extra: dict[str, Any] = {}
        self.scaler_events: list[ScalerEvent] = []
        self.dtypes: set[str] = set()
        self.devices: set[str] = set()
        self.autocast_seen = False
        self.scaler_seen = False
        # one more than asked: the step in flight, whose last rows arrive with the next transfer
        self._steps: deque[_StepData] = deque(maxlen=self.keep_steps + 1)
        self._step_records: dict[int, StepRecord] = {}
        self._step_order: deque[int] = deque(maxlen=max(self.keep_steps, HISTORY))
        self._layers: dict[str, _LayerAcc] = {}
        self._grad_hist: dict[str, np.ndarray] = {}
        self._names = WeakIdKeyDictionary()  # module -> name
        self._types: dict[str, str] = {}
        self._roots: list[tuple[weakref.ref, str]] = []
        self._primary_set = False
        self._primary_root: weakref.ref | None = None
        self._lazy = False  # a lazy module's parameters still await their first forward
        self._param_names = WeakIdKeyDictionary()  # parameter -> (name, owner module name)
        self._param_hooks: list[Any] = []
        self._skip_streak = 0
        self._fact_keys: set[tuple[str, str, str]] = set()
        self._active = False
        self._step = 0
        self._problem_steps: list[int] = []
        self._stop_pending = False
        self._saw_optimizer = False
        self._failure_order = self._origin_order = 0
        self._optimizer_ran_step = -1
        self._unscaled_step = -1
        self._closure_step = -1
        self._optimizers_seen: set[int] = set()
        self._optimizer_exists = self._optimizer_ref is not None
        self._last_counted_skip = -1
        self._metas: list[_Meta] = []  # this step's rows (and rows still queued from the last)
        self._flushed = 0  # how many of self._metas have crossed to the host
        self._pending_rows: list[torch.Tensor] = []
        self._pending_scalars: list[torch.Tensor] = []
        self._pending_scalar_keys: list[tuple[int, str]] = []
        self._begin_step_state()

    def _begin_step_state(self) -> None:
        self._order = 0
        self._frames: list[_Frame] = []
        self._calls: list[_Call] = []
        self._seen: dict[int, tuple[int, int, Any]] = {}  # id(tensor) -> (meta idx, version, ref)
        self._grad_handles: list[Any] = []
        self._grads: dict[int, torch.Tensor] = {}  # meta idx -> gradient (failing-step replay)
        self._grad_params: dict[int, torch.Tensor] = {}  # for the step's gradient norm
        self._opt_params: list[torch.Tensor] | None = None  # the stepping optimizer's
        self._clip_norm: torch.Tensor | None = None  # returned by clip_grad_norm_
        self._targets: dict[int, torch.Tensor] = {}  # loss targets seen this step
        self._scaled_backward = False  # the running backward is of a GradScaler-scaled loss
        self._scaled_grad_params: set[int] = set()
        self._metas = self._metas[self._flushed:]
        self._flushed = 0
        self._full = self._step % self.sample_every == 0 or bool(self._problem_steps)
        if self.sample_every > 1 and self._stack is not None:
            self._set_module_hooks(self._full or not (self._saw_optimizer or self.scaler_seen))
        self._did_backward = False
        self._scaled_losses: list[weakref.ref] = []  # by identity: ids of freed ones are reused
        self._transferred = False
        self._step_scaler = False

    # -- public API ---------------------------------------------------------------------

    @property
    def steps(self) -> list[StepRecord]:
        """One record per step seen (the most recent ``keep_steps`` thousand at most)."""
        return [self._step_records[i] for i in self._step_order if i in self._step_records]

    @property
    def layers(self) -> list[LayerStats]:
        """Per-module forward and backward ranges over the recorded steps, execution order."""
        return [self._layer_stats(acc) for acc in self._layers.values()]

    @property
    def step(self) -> int:
        """Index of the step now being recorded."""
        return self._step

    def records(self, step: int | None = None) -> list[TensorRecord]:
        """Decoded tensor records of a step still in the ring buffer (default: the last)."""
        data = self._find_step(step)
        if data is None:
            return []
        return [self._tensor_record(m, r) for m, r in sorted(
            zip(data.metas, data.rows), key=lambda mr: mr[0].order)]

    def start(self) -> Hunt:
        global _ACTIVE
        with _LOCK:
            if _ACTIVE is not None:
                raise NanhuntError("another nanhunt session is already active in this process")
            _ACTIVE = self
        try:
            self._install()
        except BaseException:
            if self._stack is not None:  # roll a partial install back
                self._stack.close()
                self._stack = None
            for h in self._param_hooks:
                h.remove()
            self._param_hooks = []
            with _LOCK:
                _ACTIVE = None
            raise
        return self

    def stop(self) -> None:
        """Flush the last step, detach every hook and restore everything patched."""
        global _ACTIVE
        if self._stack is None:
            return
        try:
            with contextlib.suppress(StopRun):
                self._flush()
        finally:
            self._active = False
            self._clear_step_handles()
            self._stack.close()
            self._stack = None
            for h in self._param_hooks:
                h.remove()
            self._param_hooks = []
            self._calls = []
            self._seen = {}
            self._grads = {}
            self._names = WeakIdKeyDictionary()
            self._param_names = WeakIdKeyDictionary()
            self._roots = []
            self._model_ref = self._optimizer_ref = self._scaler_ref = None
            with _LOCK:
                if _ACTIVE is self:
                    _ACTIVE = None

    def __enter__(self) -> Hunt:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.stop()
        if exc is not None and self.first_failure is not None and hasattr(exc, "add_note"):
            exc.add_note(f"nanhunt: first non-finite value at {self.first_failure.where()}")
        return False

    def request_stop(self) -> None:
        """Ask a session with ``stop_on_problem`` to stop the script at the end of this step
        (another rank of a distributed run found a problem)."""
        self._stop_pending = True

    def end_step(self) -> None:
        """Mark a step boundary by hand (for loops that never call an optimizer)."""
        self._end_step()

    # -- installation -------------------------------------------------------------------

    def _install(self) -> None:
        with contextlib.ExitStack() as stack:
            self._set_module_hooks(True)
            stack.callback(self._set_module_hooks, False)
            stack.enter_context(_O.register_optimizer_step_pre_hook(self._on_opt_pre))
            stack.enter_context(_O.register_optimizer_step_post_hook(self._on_opt_post))
            self._patch(stack, torch.Tensor, "backward", self._wrap_backward)
            scaler_cls = torch.amp.GradScaler
            self._patch(stack, scaler_cls, "scale", self._wrap_scale)
            self._patch(stack, scaler_cls, "update", self._wrap_update)
            self._patch(stack, scaler_cls, "unscale_", self._wrap_unscale)
            self._patch(stack, torch.optim.Optimizer, "__init__", self._wrap_optimizer_init)
            clip = self._wrap_clip(torch.nn.utils.clip_grad_norm_)
            for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
                if getattr(owner, "clip_grad_norm_", None) is not None:
                    stack.callback(setattr, owner, "clip_grad_norm_", owner.clip_grad_norm_)
                    owner.clip_grad_norm_ = clip
            self._stack = stack.pop_all()
        model = self._model_ref() if self._model_ref else None
        if model is not None:
            self._add_root(model, primary=True, label=type(model).__name__)
        self._active = True

    def _set_module_hooks(self, on: bool) -> None:
        """Global module hooks slow every module call, so sampled mode drops them between
        sampled steps."""
        if on and not self._module_handles:
            self._module_handles = [
                _M.register_module_forward_pre_hook(self._on_pre),
                _M.register_module_forward_hook(self._on_post, with_kwargs=True),
            ]
        elif not on:
            for h in self._module_handles:
                h.remove()
            self._module_handles = []

    @staticmethod
    def _patch(stack: contextlib.ExitStack, owner: type, name: str, wrapper: Any) -> None:
        original = owner.__dict__[name]
        setattr(owner, name, wrapper(original))
        stack.callback(setattr, owner, name, original)

    # -- naming -------------------------------------------------------------------------

    def _add_root(self, root: nn.Module, *, primary: bool = False,
                  label: str | None = None) -> None:
        label = label or _variable_name(root) or type(root).__name__
        has_params = next(root.parameters(), None) is not None
        if self._primary_root is not None and self._primary_root() is root:
            primary = True  # named again (a lazy or late module): keep its names
        elif not self._primary_set and (primary or has_params):
            primary, self._primary_set = True, True
            self._primary_root = weakref.ref(root)
        else:
            primary = False
        if all(ref() is not root for ref, _ in self._roots):
            self._roots.append((weakref.ref(root), label))
        inner = _unwrap(root)
        if inner is not root:  # DDP & co: name the user's modules as in their own model
            self._names[root] = label
            self._types[label] = type(root).__name__
            root = inner
        for qual, mod in root.named_modules():
            name = (qual or label) if primary else (f"{label}.{qual}" if qual else label)
            self._names[mod] = name
            self._types[name] = type(mod).__name__
            for pname, p in mod.named_parameters(recurse=False):
                if isinstance(p, nn.parameter.UninitializedParameter):
                    self._lazy = True  # named again once a forward has materialised it
                    continue
                if p.requires_grad and p not in self._param_names:
                    full = (f"{qual}.{pname}" if qual else pname) if primary else \
                        f"{name}.{pname}"
                    self._param_names[p] = (full, name)
                    self._param_hooks.append(
                        p.register_post_accumulate_grad_hook(self._on_param_grad))

    def _name_of(self, module: nn.Module) -> str:
        name = self._names.get(module)
        if name is not None:
            if self._lazy and not self._frames:
                self._lazy = False
                for ref, label in list(self._roots):
                    root = ref()
                    if root is not None and any(m is module for m in root.modules()):
                        self._add_root(root, label=label)
            return name
        if self._frames:
            # a module created after its root was named: look again, then name it by its class
            for ref, _label in self._roots:
                root = ref()
                if root is not None and any(m is module for m in root.modules()):
                    self._add_root(root, label=_label)
                    name = self._names.get(module)
                    if name is not None:
                        return name
            name = f"{self._frames[-1].name}.<{type(module).__name__}>"
            self._names[module] = name
            self._types[name] = type(module).__name__
            return name
        self._add_root(_owner_of(module))
        return self._names[module]

    # -- recording ----------------------------------------------------------------------

    def _queue(self, t: torch.Tensor, meta: _Meta) -> int:
        self._pending_rows.append(_stats.summarize(t, self.format))
        self._metas.append(meta)
        self.dtypes.add(meta.dtype)
        return len(self._metas) - 1

    def _scalar(self, value: torch.Tensor, key: str) -> None:
        self._pending_scalars.append(value.detach().reshape(-1)[:1].double())
        self._pending_scalar_keys.append((self._step, key))

    def _next_order(self) -> int:
        self._order += 1
        return self._order

    def _lookup(self, t: torch.Tensor) -> int | None:
        hit = self._seen.get(id(t))
        if hit is None:
            return None
        idx, version, ref = hit
        obj = ref() if isinstance(ref, weakref.ref) else ref
        if obj is not t or _version(t) != version:
            return None
        return idx

    def _remember(self, t: torch.Tensor, idx: int) -> None:
        # without autograd nothing keeps activations alive: neither does nanhunt
        ref = t if self.keep_tensors and torch.is_grad_enabled() else weakref.ref(t)
        self._seen[id(t)] = (idx, _version(t), ref)

    def _allowed(self, module: str, tensor: str) -> bool:
        return any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(f"{module}.{tensor}", p)
                   for p in self.allow_inf)

    @_safe
    def _on_pre(self, module: nn.Module, args: tuple) -> None:
        if not self._active or _skip():
            return
        if _in_backward():
            return  # activation-checkpoint recompute
        if not self._frames:
            self._end_step_if_over()
        if not self._full:
            return
        name = self._name_of(module)
        call = len(self._calls)
        parent = self._frames[-1].call if self._frames else None
        self._calls.append(_Call(call, module, name, parent))
        versions = [(t, _version(t)) for t in args if isinstance(t, torch.Tensor)]
        self._frames.append(_Frame(module, name, call, self._next_order(), versions))

    def _end_step_if_over(self) -> None:
        """A new forward (or backward) after the optimizer ran starts a new step: several
        optimizers in one iteration stay one step, and a missing scaler.update() still ends it."""
        if self._optimizer_ran_step == self._step:
            self._end_step()
        elif self._did_backward and not self._saw_optimizer and not self._step_scaler \
                and not self._optimizer_exists:
            self._end_step()  # a loop with no optimizer: a new forward starts a new step

    def _pop_frame(self, module: nn.Module) -> _Frame | None:
        while self._frames:
            frame = self._frames.pop()
            if frame.module is module:
                return frame
        return None

    @_safe
    def _on_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._active or not self._full or _in_backward() or _skip():
            return
        frame = self._pop_frame(module)
        if frame is None:
            return
        call = self._calls[frame.call]
        name, parent = frame.name, call.parent
        mutated_ids = {id(t) for t, v in frame.versions if _version(t) != v}
        leaves = _call_leaves(args, kwargs)
        grad_on = torch.is_grad_enabled()
        for path, t in leaves:
            if not _stats.summarizable(t):
                continue
            idx = self._lookup(t)
            if idx is not None:
                m = self._metas[idx]
                if m.role == "input" and m.order > frame.order and idx >= self._flushed:
                    # made outside this call and first seen by an inner one: it enters here
                    self._describe_input(m, frame, call, path, t)
                m.consumers.append(frame.call)
                m.consumer_paths.append(path)
                continue
            mutated = id(t) in mutated_ids
            meta = _Meta(
                step=self._step, order=frame.order, phase="forward", module="", tensor=path,
                role="input", dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
                owner=name, consumers=[] if mutated else [frame.call],
                consumer_paths=[] if mutated else [path],
            )
            if mutated:  # changed in place by this very call: its output, in effect
                call.mutated_inputs.append(path)
                meta.order, meta.module, meta.role = self._next_order(), name, "output"
                meta.tensor, meta.producer, meta.parent = f"{path} (changed in place)", \
                    frame.call, parent
                meta.allowed, meta.mutated = self._allowed(name, path), True
            else:
                self._describe_input(meta, frame, call, path, t)
            idx = self._queue(t, meta)
            self._remember(t, idx)
            if grad_on and t.requires_grad:
                self._hook_grad(t, idx)
        if isinstance(module, _DROPOUT) and self._alias_through(args, output):
            return
        outs = _leaves(output, "output")
        for path, t in outs:
            if not _stats.summarizable(t):
                continue
            idx = self._lookup(t)
            if idx is not None:
                m = self._metas[idx]
                if m.producer != frame.call and m.role == "output":
                    # a container passing its child's output through: the same values
                    m.also_producers.append(frame.call)
                    m.also_owners.append(name)
                    call.output_rows.append(idx)
                    continue
                if m.producer == frame.call:
                    continue
                if frame.call in m.consumers:  # returns its own input (nn.Identity): the same
                    m.also_producers.append(frame.call)
                    call.output_rows.append(idx)
                    continue
            meta = _Meta(
                step=self._step, order=self._next_order(), phase="forward", module=name,
                tensor=path, role="output", dtype=str(t.dtype).removeprefix("torch."),
                shape=tuple(t.shape), owner=name, producer=frame.call, parent=parent,
                allowed=self._allowed(name, path),
            )
            idx = self._queue(t, meta)
            call.output_rows.append(idx)
            self._remember(t, idx)
            if grad_on and t.requires_grad:
                self._hook_grad(t, idx)
        if self.keep_tensors and grad_on:
            call.args, call.kwargs = args, kwargs
            dev = outs[0][1].device.type if outs else "cpu"
            call.autocast = _autocast_state(dev)
            if call.autocast[0]:
                self.autocast_seen = True
        self.devices.add(outs[0][1].device.type if outs else "cpu")
        if parent is None and not grad_on and not (self._did_backward or self._saw_optimizer
                                                   or self.scaler_seen):
            self._end_step()  # inference only: each call of the model is a step

    def _alias_through(self, args: tuple, output: Any) -> bool:
        """Dropout only masks and rescales by 1/(1-p): its output's values add nothing to its
        input's, so the output is tied to the input's record instead of summarised (dropout
        outputs and their gradients are a large share of a transformer's tensors)."""
        if not isinstance(output, torch.Tensor) or len(args) != 1:
            return False
        idx = self._lookup(args[0]) if isinstance(args[0], torch.Tensor) else None
        if idx is None:
            return False
        self._remember(output, idx)
        return True

    def _describe_input(self, m: _Meta, frame: _Frame, call: _Call, path: str,
                        t: torch.Tensor) -> None:
        """Blame for an input that no module produced: the batch, or its caller's own code."""
        parent = call.parent
        parent_name = self._calls[parent].name if parent is not None else ""
        data = parent is None and t.grad_fn is None and not t.requires_grad
        m.order = frame.order
        m.phase = "data" if data else "forward"
        m.module = frame.name if data else parent_name
        m.tensor = path if data else f"{path} of {frame.name}"
        m.parent = parent
        m.allowed = self._allowed(frame.name, path) or self._allowed(parent_name, path)

    def _hook_grad(self, t: torch.Tensor, idx: int) -> None:
        self._grad_handles.append(t.register_hook(lambda g, idx=idx: self._on_grad(idx, g)))

    def _grad_meta(self, idx: int, grad: torch.Tensor, step: int) -> _Meta:
        src = self._metas[idx]
        if src.consumers:
            blamed = self._calls[src.consumers[-1]].name
            tensor = "grad_" + src.consumer_paths[-1]
        elif src.parent is not None:
            blamed = self._calls[src.parent].name
            tensor = f"grad of {src.owner}.{src.tensor}"
        else:
            blamed, tensor = "", f"grad of {src.owner}.{src.tensor}"
        return _Meta(
            step=step, order=self._next_order(), phase="backward", module=blamed, tensor=tensor,
            role="grad_input" if src.consumers else "grad_output",
            dtype=str(grad.dtype).removeprefix("torch."), shape=tuple(grad.shape),
            owner=src.owner if src.role == "output" else "", producer=None, parent=None,
            also_owners=list(src.also_owners),
        )

    @_safe
    def _on_grad(self, idx: int, grad: torch.Tensor) -> None:
        if not self._active or idx >= len(self._metas) or not _stats.summarizable(grad) \
                or _skip():
            return
        self._did_backward = True
        self._queue(grad, self._grad_meta(idx, grad, self._step))
        if self.keep_tensors:
            self._grads[idx] = grad

    @_safe
    def _on_param_grad(self, p: torch.Tensor) -> None:
        if not self._active or p.grad is None or _skip():
            return
        self._did_backward = True
        name, owner = self._param_names.get(p, ("<param>", ""))
        g = p.grad
        self._grad_params[id(p)] = p
        if self._scaled_backward:
            self._scaled_grad_params.add(id(p))
        if not self._full or not _stats.summarizable(g):
            return
        self._queue(g, _Meta(
            step=self._step, order=self._next_order(), phase="backward", module=owner,
            tensor=f"{name}.grad", role="param_grad", dtype=str(g.dtype).removeprefix("torch."),
            shape=tuple(g.shape), owner=owner,
        ))

    def _misuse(self, code: str) -> None:
        rec = self._step_record(self._step)
        if code not in rec.misuse:
            rec.misuse.append(code)

    @torch.no_grad()
    def _queue_params(self, params: list[torch.Tensor]) -> None:
        """Updated parameters, cheaply: one fused max-norm kernel per device gives each one's
        amax, and NaN/inf when it went non-finite; a culprit is summarised exactly later."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in params:
            by_device.setdefault(p.device, []).append(p)
        for device, ps in by_device.items():
            norms = torch.stack(_foreach_norm(ps, math.inf)).double()
            rows = torch.zeros((len(ps), _stats.ROW_LEN), dtype=torch.float64, device=device)
            # numel is filled in on the host (no host-to-device copy here)
            rows[:, 1] = torch.isnan(norms).double()
            rows[:, 2] = torch.isinf(norms).double()
            rows[:, 5] = torch.where(torch.isfinite(norms), norms, 0.0)
            rows[:, 6] = math.inf
            self._pending_rows.extend(rows.unbind(0))
            for p in ps:
                name, owner = self._param_names.get(p, ("<param>", ""))
                self._metas.append(_Meta(
                    step=self._step, order=self._next_order(), phase="optimizer", module=owner,
                    tensor=name, role="param", dtype=str(p.dtype).removeprefix("torch."),
                    shape=tuple(p.shape), owner=owner, approx=weakref.ref(p)))
                self.dtypes.add(str(p.dtype).removeprefix("torch."))

    def _record_loss(self, loss: torch.Tensor, role: str) -> None:
        if not _stats.summarizable(loss):
            return
        if self._full:
            self._record_loss_targets(loss)
        self._scalar(loss.detach().float().mean() if loss.numel() != 1 else loss, "loss")
        self._queue(loss, _Meta(
            step=self._step, order=self._next_order(), phase="forward", module="",
            tensor="loss", role=role, dtype=str(loss.dtype).removeprefix("torch."),
            shape=tuple(loss.shape),
        ))

    def _record_loss_targets(self, loss: torch.Tensor) -> None:
        """Targets handed to a loss function (``F.mse_loss(pred, target)``): no module ever
        sees them, but the loss's autograd node saved them; a NaN there is bad data."""
        node, todo, seen = None, [loss.grad_fn], 0
        while todo and seen < 8:
            node = todo.pop(0)
            if node is None:
                continue
            seen += 1
            if "Loss" in type(node).__name__ or "Entropy" in type(node).__name__:
                target = getattr(node, "_saved_target", None)
                if isinstance(target, torch.Tensor) and _stats.summarizable(target) \
                        and self._lookup(target) is None:
                    op = type(node).__name__.removesuffix("Backward0").removesuffix("Backward")
                    idx = self._queue(target, _Meta(
                        step=self._step, order=self._next_order(), phase="data", module="",
                        tensor=f"target of {op}", role="input",
                        dtype=str(target.dtype).removeprefix("torch."),
                        shape=tuple(target.shape)))
                    self._remember(target, idx)
                    self._targets[idx] = target
            todo.extend(fn for fn, _ in node.next_functions)

    # -- patched entry points -------------------------------------------------------------

    def _wrap_backward(self, original: Any) -> Any:
        hunt = self

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            hunt._guard(hunt._before_backward, tensor)
            return original(tensor, *args, **kwargs)

        backward.__wrapped__ = original  # type: ignore[attr-defined]
        return backward

    def _before_backward(self, tensor: torch.Tensor) -> None:
        if self._active and not _in_backward() and self._closure_step != self._step \
                and self._optimizer_ran_step == self._step:
            self._end_step()
        if self._active and not _in_backward():
            self._scaled_backward = any(r() is tensor for r in self._scaled_losses)
            if not self._scaled_backward:
                self._record_loss(tensor, "loss")
            self._did_backward = True

    def _wrap_scale(self, original: Any) -> Any:
        hunt = self

        def scale(scaler: Any, outputs: Any) -> Any:
            result = original(scaler, outputs)
            hunt._guard(hunt._after_scale, scaler, outputs, result)
            return result

        scale.__wrapped__ = original  # type: ignore[attr-defined]
        return scale

    def _after_scale(self, scaler: Any, outputs: Any, result: Any) -> None:
        if self._active and scaler.is_enabled():
            self.scaler_seen = self._step_scaler = True
            if isinstance(outputs, torch.Tensor):
                self._record_loss(outputs, "loss")
                self._scaled_losses.append(weakref.ref(result))
            if scaler._scale is not None:
                self._scalar(scaler._scale, "scale")
            self._scaler_ref = weakref.ref(scaler)

    def _wrap_update(self, original: Any) -> Any:
        hunt = self

        def update(scaler: Any, new_scale: Any = None) -> None:
            tracked = hunt._guard(hunt._before_update, scaler)
            result = original(scaler, new_scale)
            if tracked:
                hunt._guard(hunt._after_update, scaler)
            return result

        update.__wrapped__ = original  # type: ignore[attr-defined]
        return update

    def _before_update(self, scaler: Any) -> bool:
        if not (self._active and scaler.is_enabled() and scaler._scale is not None):
            return False
        self.scaler_seen = True
        found = [f for s in scaler._per_optimizer_states.values()
                 for f in s["found_inf_per_device"].values()]
        if found and not self._step_scaler and self._did_backward:
            self._misuse("unscaled_loss")
        if found:
            self._scalar(sum(f.to(scaler._scale.device) for f in found), "found_inf")
        self._scalar(scaler._scale.clone(), "scale_before")
        return True

    def _after_update(self, scaler: Any) -> None:
        self._scalar(scaler._scale.clone(), "scale_after")
        self._end_step()

    def _wrap_optimizer_init(self, original: Any) -> Any:
        hunt = self

        def __init__(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            hunt._optimizer_exists = True  # micro-batches before its first step are one step
            return original(optimizer, *args, **kwargs)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        return __init__

    def _wrap_unscale(self, original: Any) -> Any:
        hunt = self

        def unscale_(scaler: Any, optimizer: Any) -> None:
            hunt._unscaled_step = hunt._step
            return original(scaler, optimizer)

        unscale_.__wrapped__ = original  # type: ignore[attr-defined]
        return unscale_

    def _wrap_clip(self, original: Any) -> Any:
        hunt = self

        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            if hunt._active and hunt._step_scaler and hunt._unscaled_step != hunt._step:
                hunt._misuse("clip_on_scaled_grads")
            total = original(*args, **kwargs)
            if hunt._active and isinstance(total, torch.Tensor):
                # the norm before clipping: what the step's gradients really were
                hunt._clip_norm = total.detach()
            return total

        clip_grad_norm_.__wrapped__ = original  # type: ignore[attr-defined]
        return clip_grad_norm_

    # -- nanhunt's own failures ---------------------------------------------------------------

    def _guard(self, fn: Any, *args: Any) -> Any:
        """Run nanhunt's part of a hook; a bug of ours must never break the user's training."""
        try:
            return fn(*args)
        except Exception as exc:
            self._internal_failure(exc)
            return None

    def _internal_failure(self, exc: Exception) -> None:
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
        self.internal_errors.append(f"{type(exc).__name__}: {exc}{where}")
        if self._active:
            self._active = False
            print(f"nanhunt: internal error ({type(exc).__name__}: {exc}{where}); tracing "
                  "stopped, your run continues", file=sys.stderr)

    @_safe
    def _on_opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._active:
            return
        self._saw_optimizer = True
        self._optimizers_seen.add(id(optimizer))
        scaler = self._scaler_ref() if self._scaler_ref is not None else None
        if self._step_scaler and scaler is not None and scaler.is_enabled():
            # scaler.step(optimizer) unscales first; a direct optimizer.step() does not
            state = scaler._per_optimizer_states.get(id(optimizer))
            stage = getattr(state.get("stage"), "name", "READY") if state else "READY"
            owns = any(id(p) in self._scaled_grad_params
                       for g in optimizer.param_groups for p in g["params"])
            if stage == "READY" and owns:  # (an fp32 side model may step on its own loss)
                self._misuse("optimizer_on_scaled_grads")
        self._optimizer_ran_step = self._step
        self._data_for(self._step).optimizer_ran = True  # known on the host: no transfer
        # the norm of what this optimizer steps on (a GAN's other model may hold gradients
        # that no optimizer uses, still scaled)
        self._opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        if kwargs.get("closure") is not None or (args and callable(args[0])):
            self._closure_step = self._step  # LBFGS & co: the transfer waits for the closure
            return
        self._flush()  # the step's one transfer, before the update changes the weights

    @_safe
    def _on_opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._active:
            return
        if self._closure_step == self._step:
            self._flush()  # the closure ran the forward and backward inside step()
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None and _stats.summarizable(p) and not p.is_sparse]
        if params:
            self._queue_params(params)
        # with one optimizer the step ends here (so a distributed run agrees on stopping
        # while every rank is still in step); once several optimizers step, at the next
        # forward: a GAN's second optimizer belongs to the same iteration
        if not self._step_scaler and len(self._optimizers_seen) == 1:
            self._end_step()

    # -- step boundaries and the transfer ---------------------------------------------------

    def _end_step(self) -> None:
        if not self._transferred:
            self._flush()
        self._step_record(self._step)
        self._clear_step_handles()
        if self.on_step is not None:
            self.on_step(self._step_records[self._step], self)
        stop = self._stop_pending and self.stop_on_problem
        self._step += 1
        self._begin_step_state()
        if stop:
            self._stop_pending = False
            raise StopRun(f"nanhunt stopped the script after step {self._step - 1}, "
                          "where the first non-finite value appeared")
        if self.max_steps is not None and self._step >= self.max_steps:
            raise StopRun(f"nanhunt stopped the script after {self._step} steps (--max-steps)")

    @torch.no_grad()
    def _queue_grad_norm(self) -> None:
        """The global norm of the gradients the optimizer sees (already unscaled by GradScaler
        when it runs), one fused kernel per device."""
        if self._clip_norm is not None:  # clip_grad_norm_ already measured it, before clipping
            self._scalar(self._clip_norm.double().pow(2), "grad_sumsq")
            self._clip_norm, self._grad_params, self._opt_params = None, {}, None
            return
        params = self._opt_params if self._opt_params is not None else \
            self._grad_params.values()
        grads = [p.grad for p in params if p.grad is not None]
        self._grad_params, self._opt_params = {}, None
        if not grads:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            if not g.is_sparse:
                by_device.setdefault(g.device, []).append(g)
        total = None
        for device_grads in by_device.values():
            norms = torch.stack(_foreach_norm(device_grads, 2.0))
            part = norms.double().pow(2).sum()
            total = part if total is None else total + part.to(total.device)
        if total is not None:
            self._scalar(total, "grad_sumsq")

    def _clear_step_handles(self) -> None:
        for h in self._grad_handles:
            h.remove()
        self._grad_handles = []

    def _flush(self) -> None:
        """Move every queued row to the host in one transfer and digest it."""
        self._transferred = True
        self._queue_grad_norm()
        rows, scalars, keys = self._pending_rows, self._pending_scalars, self._pending_scalar_keys
        if not rows and not scalars:
            return
        metas = self._metas[self._flushed:self._flushed + len(rows)]
        self._flushed += len(rows)
        devices = {p.device for p in (*rows, *scalars)}
        if len(devices) == 1:
            parts = ([torch.stack(rows).reshape(-1)] if rows else []) + scalars
            flat = torch.cat(parts).cpu().numpy()
        else:  # model parallel: one transfer per piece's device
            flat = np.concatenate([r.cpu().numpy() for r in rows]
                                  + [x.cpu().numpy() for x in scalars])
        n = len(rows) * _stats.ROW_LEN
        matrix = flat[:n].reshape(len(rows), _stats.ROW_LEN)
        values = flat[n:]
        self._pending_rows, self._pending_scalars, self._pending_scalar_keys = [], [], []
        self._data_for(self._step).parents.update({c.id: c.parent for c in self._calls})
        self._digest(metas, matrix, list(zip(keys, values)))

    # -- host side ----------------------------------------------------------------------------

    def _data_for(self, step: int) -> _StepData:
        for d in reversed(self._steps):
            if d.index == step:
                return d
        d = _StepData(index=step)
        self._steps.append(d)
        return d

    def _find_step(self, step: int | None) -> _StepData | None:
        if not self._steps:
            return None
        if step is None:
            return self._steps[-1]
        for d in self._steps:
            if d.index == step:
                return d
        return None

    def _digest(self, metas: list[_Meta], matrix: np.ndarray, scalars: list) -> None:
        touched: dict[int, _StepData] = {}
        new = metas
        for (step, key), value in scalars:
            d = touched.get(step) or touched.setdefault(step, self._data_for(step))
            if key == "loss":
                d.loss = float(value)
            elif key == "scale" or key == "scale_before":
                d.scale = float(value)
            elif key == "scale_after":
                d.scale_after = float(value)
            elif key == "found_inf":
                d.found_inf = bool(value > 0)
            elif key == "grad_sumsq":  # one per optimizer that stepped
                d.grad_sumsq = (d.grad_sumsq or 0.0) + float(value)
        arrived = []
        for meta, row in zip(new, matrix):
            if meta.approx is not None:
                row[0] = math.prod(meta.shape)
            d = touched.get(meta.step) or touched.setdefault(meta.step,
                                                             self._data_for(meta.step))
            d.metas.append(meta)
            d.rows.append(row)
            arrived.append((meta, row, d))
        for step in sorted(touched):
            self._update_step(touched[step])
        for meta, row, d in arrived:
            if self._before_failure(meta) and not (meta.phase == "backward" and d.found_inf
                                                    and d.problem is None):
                # (gradients of a step GradScaler skipped overflowed on purpose: not a range)
                self._accumulate(meta, row, d)

    def _before_failure(self, meta: _Meta) -> bool:
        """Per-layer ranges stop at the origin: what follows it is contaminated."""
        f = self.first_failure
        if f is None or meta.step < f.step:
            return True
        return meta.step == f.step and meta.order <= self._failure_order

    def _accumulate(self, meta: _Meta, row: np.ndarray, d: _StepData) -> None:
        if meta.phase == "backward":
            self._add_grad_hist(meta.dtype, row, d.scale)
        for owner in (meta.owner, *meta.also_owners):
            if owner:
                self._accumulate_into(owner, meta, row)

    def _accumulate_into(self, owner: str, meta: _Meta, row: np.ndarray) -> None:
        acc = self._layers.get(owner)
        if acc is None:
            acc = self._layers[owner] = _LayerAcc(owner, self._types.get(owner, ""))
        if meta.role == "output":
            acc.calls += 1
            acc.dtypes.add(meta.dtype)
            acc.forward = _merge_rows(acc.forward, row)
            acc.fwd_by_step[meta.step] = max(acc.fwd_by_step.get(meta.step, 0.0), float(row[5]))
        elif meta.role == "grad_output" or (meta.role == "grad_input" and meta.owner):
            acc.backward = _merge_rows(acc.backward, row)
            acc.bwd_by_step[meta.step] = max(acc.bwd_by_step.get(meta.step, 0.0), float(row[5]))
        elif meta.role == "param_grad":
            acc.param_grad = _merge_rows(acc.param_grad, row)
        elif meta.role == "param":
            acc.param_by_step[meta.step] = max(acc.param_by_step.get(meta.step, 0.0),
                                               float(row[5]))

    def _add_grad_hist(self, dtype: str, row: np.ndarray, scale: float | None) -> None:
        """Add a gradient's exponent histogram, unscaled, to the run's histogram."""
        shift = 0
        if scale and scale > 0 and math.isfinite(scale):
            shift = round(math.log2(scale))
        hist = self._grad_hist.get(dtype)
        if hist is None:
            hist = self._grad_hist[dtype] = np.zeros(2 * _HIST_OFFSET, dtype=np.float64)
        lo = _HIST_OFFSET + 1 - 127 - shift  # index of exponent-field 1's binade
        if lo >= 0 and lo + 254 <= len(hist):
            hist[lo:lo + 254] += row[_stats._HEAD + 1:_stats._HEAD + 255]

    def grad_histograms(self) -> dict[str, dict[int, int]]:
        """Unscaled gradient exponent histograms (binade -> count), by gradient dtype."""
        out = {}
        for dtype, hist in self._grad_hist.items():
            nz = np.nonzero(hist)[0]
            out[dtype] = {int(i) - _HIST_OFFSET: int(hist[i]) for i in nz}
        return out

    def _step_record(self, index: int) -> StepRecord:
        """The step's record, made on first use; the oldest are dropped past HISTORY steps."""
        rec = self._step_records.get(index)
        if rec is None:
            rec = self._step_records[index] = StepRecord(index=index)
            if len(self._step_order) == self._step_order.maxlen:
                self._step_records.pop(self._step_order[0], None)
            self._step_order.append(index)
            if index % max(1, HISTORY // 10) == 0:
                self._prune_history(index - HISTORY)
        return rec

    def _prune_history(self, oldest: int) -> None:
        for acc in self._layers.values():
            for by_step in (acc.fwd_by_step, acc.bwd_by_step, acc.param_by_step):
                for k in [k for k in by_step if k < oldest]:
                    del by_step[k]

    def _update_step(self, d: _StepData) -> None:
        rec = self._step_record(d.index)
        rec.loss = d.loss
        rec.scale = d.scale
        nonfinite = [m for m, r in zip(d.metas, d.rows) if r[1] + r[2] + r[3] > 0]
        rec.nonfinite = bool(nonfinite) or (d.loss is not None and not math.isfinite(d.loss))
        rec.records = len(d.metas)
        if d.scale_after is not None and d.scale is not None:
            rec.skipped = bool(d.found_inf) if d.found_inf is not None else d.scale_after < d.scale
            if d.scale_after != d.scale and len(self.scaler_events) < HISTORY and not (
                    self.scaler_events and self.scaler_events[-1].step >= d.index):
                self.scaler_events.append(ScalerEvent(
                    d.index, "backoff" if d.scale_after < d.scale else "growth",
                    d.scale, d.scale_after))
        if d.grad_sumsq is not None:
            rec.grad_norm = math.sqrt(d.grad_sumsq) if math.isfinite(d.grad_sumsq) else \
                float("nan")
        self._judge(d, rec)

    def _judge(self, d: _StepData, rec: StepRecord) -> None:
        """Decide whether this step has a problem, and find the origin the first time."""
        scaled = d.scale is not None
        bad = {m.role for m, r in zip(d.metas, d.rows) if r[1] + r[2] + r[3] > 0}
        problem = None
        if (d.loss is not None and not math.isfinite(d.loss)) or "loss" in bad:
            problem = "loss"
        elif "param" in bad:
            problem = "param"
        elif "param_grad" in bad and (not scaled or d.optimizer_ran) and \
                not (scaled and d.found_inf):
            problem = "grad"
        elif self._root_output_bad(d):
            problem = "output"
        if rec.skipped and d.scale_after is not None:
            if d.index > self._last_counted_skip:
                self._last_counted_skip = d.index
                self._skip_streak += 1
                self._note_fact(("scaler", "", str(d.scale)),
                                f"step {d.index}: GradScaler found inf/NaN in the scaled gradients "
                                f"at scale {d.scale:g} and skipped the step "
                                f"(scale -> {d.scale_after:g})")
            if d.scale_after < self.collapse_scale and problem is None:
                problem = "collapse"
        elif d.scale_after is not None and not rec.skipped:
            self._skip_streak = 0
        if problem is None:
            if rec.skipped:
                rec.nonfinite = False  # GradScaler's overflow on purpose: a fact, not a mark
            elif rec.nonfinite:
                # only absorbed values (masks): not worth a mark in the timeline
                recs, parents = self._recs(d)
                loss_ok = None if d.loss is None else math.isfinite(d.loss)
                rec.nonfinite = find_origin(recs, parents, loss_ok) is not None
            self._note_absorbed(d)
            return
        d.problem = problem
        rec.nonfinite = True
        if d.index not in self._problem_steps:
            self._problem_steps.append(d.index)
        if self.first_failure is not None:
            return
        self.problem = problem
        origin_step = d
        if problem == "collapse":
            first = d.index - self._skip_streak + 1
            origin_step = self._find_step(first) or d
        failure = self._locate(origin_step, problem)
        if failure is None and origin_step is not d:
            failure = self._locate(d, problem)
        if failure is None:
            return
        self.first_failure = failure
        self._failure_order = self._origin_order
        self._take_snapshot(d, origin_step)
        self._stop_pending = True
        self._full = True

    def _root_output_bad(self, d: _StepData) -> bool:
        if d.loss is not None or any(m.role in ("loss", "param_grad") for m in d.metas):
            return False  # judged by the loss and gradients instead
        recs, parents = self._recs(d)
        origin = find_origin([r for r in recs if r.phase in ("data", "forward")], parents, None)
        if origin is None:
            return False
        roots = {c for c, p in parents.items() if p is None}
        return any(m.role == "output" and r[1] + r[2] + r[3] > 0
                   and ({m.producer, *m.also_producers} & roots)
                   for m, r in zip(d.metas, d.rows))

    def _recs(self, d: _StepData) -> tuple[list[Rec], dict[int, int | None]]:
        recs = []
        parents: dict[int, int | None] = {}
        for i, (m, r) in enumerate(zip(d.metas, d.rows)):
            nonfinite = r[1] + r[2] + r[3] > 0
            recs.append(Rec(
                index=i, order=m.order, phase=m.phase, role=m.role, nonfinite=nonfinite,
                one_sided_neginf=bool(r[3] > 0 and r[1] == 0 and r[2] == 0),
                allowed=m.allowed, producer=m.producer, parent=m.parent,
                consumers=list(m.consumers), also_producers=list(m.also_producers),
            ))
            if m.producer is not None:
                parents.setdefault(m.producer, m.parent)
            for c in m.consumers:
                parents.setdefault(c, None)
        parents.update(d.parents)
        return recs, parents

    def _locate(self, d: _StepData, problem: str) -> Failure | None:
        recs, parents = self._recs(d)
        loss_finite = None if d.loss is None else math.isfinite(d.loss)
        origin = find_origin(recs, parents, loss_finite)
        if origin is None:
            if problem == "loss" and d.loss is not None:
                return Failure(step=d.index, phase="forward", module="", tensor="loss",
                               stats=TensorStats(dtype="float32", shape=[], numel=1, nan=1),
                               detail="the loss was non-finite")
            return None
        m, r = d.metas[origin.index], d.rows[origin.index]
        self._origin_order = m.order
        phase = m.phase
        if problem == "collapse":
            phase = "loss_scaling" if m.phase == "backward" else m.phase
        return Failure(step=d.index, phase=phase, module=m.module, tensor=m.tensor,
                       stats=self._stats(m, r))

    def _stats(self, m: _Meta, row: np.ndarray) -> TensorStats:
        if m.approx is not None:  # a cheap row: summarise the tensor exactly now (a failure)
            t = m.approx()
            if t is not None:
                row = _stats.summarize(t, self.format).cpu().numpy()
        return _stats.decode(row, m.dtype, m.shape, self.format)

    def _tensor_record(self, m: _Meta, row: np.ndarray) -> TensorRecord:
        return TensorRecord(step=m.step, order=m.order, phase=m.phase, module=m.module,
                            tensor=m.tensor, role=m.role, stats=self._stats(m, row),
                            mutated=m.mutated)

    def _note_absorbed(self, d: _StepData) -> None:
        for m, r in zip(d.metas, d.rows):
            n = int(r[1] + r[2] + r[3])
            if n and m.phase in ("data", "forward"):
                key = (m.module, m.tensor, m.role)
                kinds = ", ".join(f"{int(c)} {k}" for c, k in ((r[1], "NaN"), (r[2], "+inf"),
                                                                 (r[3], "-inf")) if c)
                self._note_fact(key, f"step {d.index}: {m.module or '<top level>'} {m.tensor} "
                                     f"held {kinds}; later values stayed finite (absorbed)")

    def _note_fact(self, key: tuple, text: str) -> None:
        if key in self._fact_keys or len(self.facts) >= 50:
            return
        self._fact_keys.add(key)
        self.facts.append(text)

    # -- the culprit snapshot ------------------------------------------------------------------

    def _take_snapshot(self, d: _StepData, origin_step: _StepData) -> None:
        """Copy the culprit module and its captured inputs, while they are still unchanged."""
        f = self.first_failure
        if f is None or not self.keep_tensors:
            return
        if f.step != self._step and self.problem != "collapse":
            return  # the failing step's inputs are gone
        if f.phase == "data" and f.tensor.startswith("target of "):
            for t in self._targets.values():
                self._bad_samples_of(f.tensor, t)
            return
        # (a collapsing scale fails the same way every step: this step's call will do)
        call = next((c for c in reversed(self._calls) if c.name == f.module), None)
        if call is None or call.args is None:
            return
        stale = list(call.mutated_inputs)
        for path, t in _call_leaves(call.args, call.kwargs):
            idx = self._lookup(t)
            if idx is None and _stats.summarizable(t) and id(t) in self._seen:
                stale.append(path)
        try:
            module = copy.deepcopy(call.module)
            args = _clone_tree(call.args)
            kwargs = _clone_tree(call.kwargs)
        except Exception as exc:  # a module that cannot be copied is replayed by nobody
            self.failure_extra["snapshot_error"] = f"{type(exc).__name__}: {exc}"
            return
        grads = None
        if f.phase in ("backward", "loss_scaling"):
            grads = [self._grads.get(i) for i in call.output_rows]
            grads = [g.detach().clone() if g is not None else None for g in grads]
        self.snapshot = Snapshot(module=module, name=call.name, args=args, kwargs=kwargs,
                                 grad_outputs=grads, autocast=call.autocast, phase=f.phase,
                                 step=self._step, stale_inputs=stale,
                                 call_site=self._call_site(call))
        if f.phase == "data":
            self._bad_samples(call)
        else:
            self.snapshot.ancestors = self._ancestor_snapshots(call)

    def _ancestor_snapshots(self, call: _Call) -> list[Snapshot]:
        out: list[Snapshot] = []
        parent = call.parent
        while parent is not None:
            c = self._calls[parent]
            params = sum(p.numel() for p in c.module.parameters())
            if c.args is None or params > _MAX_ANCESTOR_COPY:
                break
            try:
                module = copy.deepcopy(c.module)
                args, kwargs = _clone_tree(c.args), _clone_tree(c.kwargs)
            except Exception:
                break
            names = {rel: self._names.get(m) or (f"{c.name}.{rel}" if rel else c.name)
                     for rel, m in c.module.named_modules()}
            out.append(Snapshot(module=module, name=c.name, args=args, kwargs=kwargs,
                                grad_outputs=None, autocast=c.autocast, phase="forward",
                                step=self._step, names=names))
            parent = c.parent
        return out

    def _call_site(self, call: _Call) -> tuple[str, int, str] | None:
        """The line in the parent's forward that calls the culprit (file, line, text)."""
        if call.parent is None:
            return None
        parent = self._calls[call.parent].module
        attr = call.name.rsplit(".", 1)[-1]
        parts = call.name.split(".")
        if attr.isdigit() and len(parts) >= 2:  # a ModuleList / Sequential element
            attr = parts[-2]
        try:
            lines, start = inspect.getsourcelines(type(parent).forward)
            fname = inspect.getsourcefile(type(parent).forward) or ""
        except (OSError, TypeError):
            return None
        for i, line in enumerate(lines):
            if f"self.{attr}" in line:
                return fname, start + i, line.strip()
        return None

    def _bad_samples(self, call: _Call) -> None:
        for path, t in _call_leaves(call.args, call.kwargs):
            self._bad_samples_of(path, t)

    def _bad_samples_of(self, path: str, t: torch.Tensor) -> None:
        if _stats.summarizable(t) and t.dim() >= 1 and t.numel():
            bad = ~torch.isfinite(t.detach()).reshape(t.shape[0], -1).all(dim=1)
            idx = torch.nonzero(bad).flatten().tolist()
            if idx:
                self.failure_extra.setdefault("bad_samples", {})[path] = idx[:100]

    # -- derived views -------------------------------------------------------------------------

    def _layer_stats(self, acc: _LayerAcc) -> LayerStats:
        def conv(row: np.ndarray | None) -> TensorStats | None:
            if row is None:
                return None
            return _stats.decode(row, "mixed" if len(acc.dtypes) > 1 else
                                 next(iter(acc.dtypes), "float32"), [], self.format)

        return LayerStats(
            module=acc.module, type=acc.type, calls=acc.calls, dtypes=sorted(acc.dtypes),
            forward=conv(acc.forward), backward=conv(acc.backward),
            param_grad=conv(acc.param_grad),
            forward_amax_by_step=dict(acc.fwd_by_step),
            backward_amax_by_step=dict(acc.bwd_by_step),
            param_amax_by_step=dict(acc.param_by_step),
        )

    def trace(self, run: RunInfo | None = None) -> Trace:
        """Everything recorded so far as a torch-free :class:`~nanhunt.trace.Trace`."""
        run = run or RunInfo()
        run.target = self.target
        run.dtypes = sorted(self.dtypes)
        run.autocast = run.autocast or self.autocast_seen
        run.scaler = run.scaler or self.scaler_seen
        if not run.device:
            run.device = ", ".join(sorted(self.devices)) or "cpu"
        failure = copy.deepcopy(self.first_failure)
        if failure is not None and self.failure_extra.get("bad_samples"):
            failure.bad_samples = dict(self.failure_extra["bad_samples"])
        return Trace(
            run=run,
            steps=copy.deepcopy(self.steps),
            layers=self.layers,
            first_failure=failure,
            problem=self.first_failure is not None,
            facts=list(self.facts),
            scaler_events=list(self.scaler_events),
            grad_hist=self.grad_histograms(),
            notes=[f"nanhunt stopped tracing after an internal error: {e}"
                   for e in self.internal_errors],
        )


def _clone_tree(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.detach().clone())


@contextlib.contextmanager
def watch(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    target: str = "float16",
    **options: Any,
) -> Iterator[Hunt]:
    """Watch the training steps run inside the block; see :class:`Hunt`."""
    hunt = Hunt(model, optimizer, scaler, target=target, **options)
    with hunt:
        yield hunt
