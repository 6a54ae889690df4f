"""The data the capture parts share: queued-row metadata, module calls, step records, and the
current step's tensor identity map (:class:`StepState`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from nanhunt.capture._util import _version


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
    call: int | None = None  # for a gradient row: the module call whose backward made it
    sharded: bool = False  # computed on this rank's shard of a DTensor (reduced across ranks)


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
    site: tuple[str, int, str] | None = None  # a root call's caller (file, line, text)


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
    # optimizer.step() ran outside scaler.step() on gradients GradScaler found inf/NaN in:
    # the step GradScaler "skipped" was applied after all
    applied_anyway: bool = False


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
    pgrad_by_step: dict[int, float] = field(default_factory=dict)  # as stored (scaled)
    pgrad_dtypes: set[str] = field(default_factory=set)  # float32 master grads under autocast


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


@dataclass
class OptimizerSnapshot:
    """A copy of an optimizer (its parameters, their gradients, its state) taken just before
    a step, to replay that step under the op recorder when it made a parameter non-finite."""

    optimizer: Any
    step: int
    type: str


class StepState:
    """What the step in flight has seen: its module calls and open frames, each tensor already
    recorded (by identity and version), the gradient hooks to drop at its end, and the tensors
    kept to replay the culprit. A session replaces it whole at every step boundary."""

    def __init__(self, keep_tensors: bool) -> None:
        self.keep_tensors = keep_tensors
        self.order = 0
        self.frames: list[_Frame] = []
        self.calls: list[_Call] = []
        self.seen: dict[int, tuple[int, int, Any]] = {}  # id(tensor) -> (meta idx, version, ref)
        self.grad_handles: list[Any] = []
        self.grads: dict[int, torch.Tensor] = {}  # meta idx -> gradient (failing-step replay)
        self.grad_params: dict[int, torch.Tensor] = {}  # for the step's gradient norm
        self.opt_params: list[torch.Tensor] | None = None  # the stepping optimizer's
        # the step's gradient norm if measured already: clip_grad_norm_'s return (before clipping),
        # or a sentinel's gradient check
        self.clip_norm: torch.Tensor | None = None
        self.targets: dict[int, torch.Tensor] = {}  # loss targets seen this step
        self.scaled_backward = False  # the running backward is of a GradScaler-scaled loss
        self.scaled_grad_params: set[int] = set()
        self.did_backward = False
        # a top-level module call ran with grad enabled on a module in training mode: this step
        # trains (an evaluation forward after the last optimizer step does not)
        self.trains = False
        self.scaled_losses: list[weakref.ref] = []  # by identity: ids of freed ones are reused
        self.transferred = False
        self.step_scaler = False
        # the learning rate the step's optimizer stepped with (read in its pre-hook, after a
        # --fix's factor; with GradScaler, when it skipped the step): a schedule's next value,
        # set after the step, is not this step's
        self.lr: float | None = None
        self.traced = True  # the step began with full tracing (not skipped by --sample-every)
        # (id(optimizer), its copy before this step's update): kept if the update goes bad
        self.optimizer_copy: tuple[int, OptimizerSnapshot] | None = None

    def next_order(self) -> int:
        self.order += 1
        return self.order

    def lookup(self, t: torch.Tensor) -> int | None:
        hit = self.seen.get(id(t))
        if hit is None:
            return None
        idx, version, ref = hit
        obj = ref() if isinstance(ref, weakref.ref) else ref
        if obj is not t or _version(t) != version:
            return None
        return idx

    def remember(self, t: torch.Tensor, idx: int) -> None:
        # without autograd nothing keeps activations alive: neither does nanhunt
        ref = t if self.keep_tensors and torch.is_grad_enabled() else weakref.ref(t)
        self.seen[id(t)] = (idx, _version(t), ref)

    def clear_handles(self) -> None:
        for h in self.grad_handles:
            h.remove()
        self.grad_handles = []


class Part:
    """One part of a session (an observer, the snapshotter): it reaches the session's shared
    state (the step in flight, the recorder, the judge) through the session that composes it."""

    def __init__(self, session: Any) -> None:
        self.s = session

    @property
    def cur(self) -> StepState:
        return self.s.cur

    @property
    def rec(self) -> Any:
        return self.s.recorder

    @property
    def judge(self) -> Any:
        return self.s.judge

    def install(self, stack: Any) -> None:
        """Register this part's hooks and patches; ``stack`` undoes them."""

    def _guard(self, fn: Any, *args: Any) -> Any:
        return self.s._guard(fn, *args)

    def _internal_failure(self, exc: Exception) -> None:
        self.s._internal_failure(exc)
