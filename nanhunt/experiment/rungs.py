"""The experiment ladder's whole-program fixes, installed from outside the script.

Each is a ``--fix`` spec (:mod:`nanhunt.fixspec`) that changes one thing about the whole run, so
that a re-run with it says what kind of failure this is (DESIGN.md §9, docs/rules.md):

``fp32-all``
    float32 everywhere: ``torch.autocast`` is entered disabled, ``.half()``, ``.bfloat16()`` and
    ``.to(float16|bfloat16)`` called by the script on a module or tensor are no-ops,
    GradScaler is made with ``enabled=False`` (it then scales nothing and skips nothing), and a
    16-bit DDP compression hook is not registered.
``bf16``
    bfloat16 instead of float16: autocast's float16 becomes bfloat16, the script's ``.half()``
    and ``.to(float16)`` give bfloat16, ``fp16_compress_hook`` becomes ``bf16_compress_hook``;
    GradScaler is left as it is.
``no-scaler``
    GradScaler made with ``enabled=False``.
``skip-batch=N``
    at step N, every outermost module call (the model, a loss module) gets the data tensors it
    was called with at step N-1 instead of step N's (features, masks, token ids alike,
    positional or keyword), and a
    functional loss called outside every module (``F.cross_entropy(logits, y)``) gets step N-1's
    target (by call order in the step): the batch is replaced by the previous one.
``skip-samples=N:I,J``
    at step N, every outermost module call, and every functional loss called outside a module
    (its target), gets its tensors with rows I, J replaced by the batch's first row not listed
    (tensors with more rows than the largest listed): the failing samples alone are replaced;
    the batch keeps its size.

Only calls made by the script are changed (not torch's own internals). :func:`install` enters
the patches on an :class:`contextlib.ExitStack`; closing it restores every patched object.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as _M
from torch.optim import optimizer as _O

from nanhunt import capture
from nanhunt._patching import patch
from nanhunt.capture._util import _in_backward
from nanhunt.fixspec import FP32_LINES_HELPER, FixSpec, sample_rows

__all__ = ["GLOBAL_KINDS", "FixMismatch", "install"]

#: the kinds this module installs
GLOBAL_KINDS = ("fp32-all", "bf16", "no-scaler", "skip-batch", "skip-samples", "fp32-lines")

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_LOW = (torch.float16, torch.bfloat16)


def _by_user(depth: int = 2) -> bool:
    """Whether the caller's caller is the script (or any code outside torch)."""
    frame = sys._getframe(depth)
    return frame is None or not frame.f_code.co_filename.startswith(_TORCH_DIR)


class FixMismatch(BaseException):
    """A fix that cannot apply to this script (its pattern names no module, no GradScaler...).

    A BaseException so that the script's own ``except Exception`` does not swallow it.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Patches:
    def __init__(self, stack: contextlib.ExitStack, applied: dict[str, set[str]]) -> None:
        self.stack = stack
        self.applied = applied

    def patch(self, owner: Any, name: str, wrapper: Any) -> None:
        if name in vars(owner):
            patch(self.stack, owner, name, wrapper)
            return
        # inherited (torch.Tensor's methods are TensorBase's): shadow it, then remove the shadow
        setattr(owner, name, wrapper(getattr(owner, name)))
        self.stack.callback(delattr, owner, name)


def _precision(p: _Patches, spec: str, new: torch.dtype | None) -> None:
    """Casts to float16/bfloat16 become casts to ``new`` (None: no cast, float32 stays)."""
    autocast_cls = torch.amp.autocast_mode.autocast
    sig = inspect.signature(autocast_cls.__init__)

    def wrap_autocast(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = sig.bind(self, *args, **kwargs)
            a = bound.arguments
            if new is None:
                if a.get("enabled", True):
                    p.applied[spec].add("autocast")
                a["enabled"] = False
            elif a.get("dtype") == torch.float16 or (
                    a.get("dtype") is None and a.get("device_type") == "cuda"):
                a["dtype"] = new
                p.applied[spec].add("autocast")
            original(*bound.args, **bound.kwargs)

        return __init__

    p.patch(autocast_cls, "__init__", wrap_autocast)

    def target(dtype: Any) -> Any:
        """What a cast to ``dtype`` becomes: the same dtype, ``new``, or None (no cast)."""
        if dtype in _LOW and (new is None or dtype == torch.float16):
            return new if new is not None else None
        return dtype

    def wrap_half(original: Any, kind: str, dtype: torch.dtype) -> Any:
        def half(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _by_user():
                return original(self, *args, **kwargs)
            to = target(dtype)
            if to == dtype:
                return original(self, *args, **kwargs)
            p.applied[spec].add(kind)
            if to is None:
                return self
            return self.to(to) if isinstance(self, torch.Tensor) else nn.Module.to(self, to)

        return half

    def wrap_to(original: Any, kind: str) -> Any:
        def to(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _by_user():
                return original(self, *args, **kwargs)
            try:
                device, dtype, non_blocking, fmt = torch._C._nn._parse_to(*args, **kwargs)
            except Exception:  # an argument _parse_to does not know: as the script wrote it
                return original(self, *args, **kwargs)
            changed = target(dtype)
            if dtype is None or changed == dtype:
                return original(self, *args, **kwargs)
            if isinstance(self, torch.Tensor) and not self.is_floating_point():
                return original(self, *args, **kwargs)
            p.applied[spec].add(kind)
            kw: dict[str, Any] = {"non_blocking": non_blocking}
            if changed is not None:
                kw["dtype"] = changed
            if device is not None:
                kw["device"] = device
            if fmt is not None and not isinstance(self, torch.Tensor):
                kw["memory_format"] = fmt
            if len(kw) == 1:
                return self
            return original(self, **kw)

        return to

    for owner, kind in ((nn.Module, "module casts"), (torch.Tensor, "tensor casts")):
        p.patch(owner, "half", lambda o, k=kind: wrap_half(o, k, torch.float16))
        p.patch(owner, "bfloat16", lambda o, k=kind: wrap_half(o, k, torch.bfloat16))
        p.patch(owner, "to", lambda o, k=kind: wrap_to(o, k))


#: DDP communication hooks that reduce the gradients in a 16-bit format
_COMPRESSION_HOOKS = ("fp16_compress_hook", "bf16_compress_hook")


def _compression(p: _Patches, spec: str, new: torch.dtype | None) -> None:
    """DDP's gradient compression follows the precision: ``None`` (float32 everywhere) registers
    no 16-bit compression hook, DDP all-reduces in the gradients' dtype; bfloat16 registers
    ``bf16_compress_hook`` for ``fp16_compress_hook`` (where DDP refuses it, without CUDA and
    NCCL or XPU, the re-run stops with that one line)."""
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP
    except Exception:  # a torch without distributed
        return

    def wrap(original: Any) -> Any:
        def register_comm_hook(ddp: Any, state: Any, hook: Any) -> Any:
            name = getattr(hook, "__name__", "")
            if new is None and name in _COMPRESSION_HOOKS:
                p.applied[spec].add(name)
                return None
            if new is torch.bfloat16 and hook is default_hooks.fp16_compress_hook:
                p.applied[spec].add(name)
                try:
                    return original(ddp, state, default_hooks.bf16_compress_hook)
                except TypeError as exc:
                    raise FixMismatch(f"--fix {spec}: DDP refuses bf16_compress_hook for "
                                      f"fp16_compress_hook: {exc}") from None
            return original(ddp, state, hook)

        return register_comm_hook

    p.patch(DDP, "register_comm_hook", wrap)


def _no_scaler(p: _Patches, spec: str) -> None:
    cls = torch.amp.GradScaler
    sig = inspect.signature(cls.__init__)

    def wrap(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = sig.bind(self, *args, **kwargs)
            if bound.arguments.get("enabled", True):
                p.applied[spec].add("GradScaler")
            bound.arguments["enabled"] = False
            original(*bound.args, **bound.kwargs)

        return __init__

    p.patch(cls, "__init__", wrap)


#: torch.nn.functional's losses whose second argument (or ``target=``) is the batch's target
LOSS_FUNCTIONS = ("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
                  "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
                  "kl_div", "poisson_nll_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
                  "multi_margin_loss", "multilabel_margin_loss")


def _data(a: Any) -> bool:
    """A batch tensor: made by the data pipeline, not by the model (no autograd history)."""
    return isinstance(a, torch.Tensor) and a.grad_fn is None and not a.requires_grad


class _SkipBatch:
    """Step ``step``'s outermost module calls get step ``step - 1``'s batch tensors (by call
    order in the step), and the targets of functional losses called outside every module
    likewise. Only data (tensors with no autograd history) is replaced: a loss module's logits
    are the model's output on the replaced batch already."""

    def __init__(self, step: int, spec: str, applied: dict[str, set[str]]) -> None:
        self.step, self.spec, self.applied = step, spec, applied
        self.depth = 0
        self.prev: dict[Any, tuple] = {}
        self.taken = 0
        self.calls: dict[Any, int] = {}  # calls so far in the current step, by key
        self.at = -1  # the step ``calls`` counts
        # keyword arguments (``model(input_ids=..., attention_mask=...)``): a global pre-hook
        # sees only the positional ones, so each outermost module gets a hook of its own that
        # sees both, at its first call (a step before any step a rung changes)
        self.stack: contextlib.ExitStack | None = None
        self.hooked: set[int] = set()
        self.hook_ids: set[int] = set()  # left out of a pickle or deep copy of the module
        self.pending: dict[int, tuple[int, Any]] = {}  # id(module) -> this call's (step, key)

    def now(self) -> int:
        hunt = capture._ACTIVE
        if hunt is None:  # without a session, the optimizer steps taken so far
            return self.taken
        # nanhunt's step (it counts the steps GradScaler skips); a step whose optimizer ran is
        # over, though nanhunt ends it only at the next forward (after these hooks: several
        # optimizers a step, no scaler.update())
        step = hunt.step
        if getattr(hunt, "_optimizer_ran_step", None) == step and \
                not getattr(hunt, "_in_closure", False):
            step += 1
        return step

    def key(self, kind: Any) -> tuple[Any, int, int]:
        """``kind`` numbered by its calls in the current step."""
        step = self.now()
        if step != self.at:
            self.at, self.calls = step, {}
            if step > self.step:
                self.prev.clear()  # done: nothing of the batch is held after its step
        n = self.calls.get(kind, 0)
        self.calls[kind] = n + 1
        return step, kind, n

    def optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.taken += 1

    def pre(self, module: nn.Module, args: tuple) -> Any:
        outermost = self.depth == 0
        self.depth += 1
        # (a checkpointed block's forward run again in the backward is no call of the step)
        if not outermost or torch.compiler.is_compiling() or _in_backward():
            return None
        step, kind, n = self.key(id(module))
        new = self.change(step, (kind, n), args)
        if new is not None:
            self.applied[self.spec].add(type(module).__name__)
        self.pending[id(module)] = (step, (kind, n))
        if id(module) not in self.hooked and self.stack is not None:
            self.hooked.add(id(module))
            handle = module.register_forward_pre_hook(self.pre_kwargs, with_kwargs=True)
            self.hook_ids.add(handle.id)
            self.stack.callback(handle.remove)
        return new

    def pre_kwargs(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The keyword tensors of the outermost call :meth:`pre` saw, as ``change`` says."""
        pending = self.pending.pop(id(module), None)
        if pending is None or not kwargs:
            return None
        step, key = pending
        names = tuple(sorted(kwargs))
        new = self.change(step, (*key, "kwargs", names), tuple(kwargs[k] for k in names))
        if new is None:
            return None
        self.applied[self.spec].add(type(module).__name__)
        return args, {**kwargs, **dict(zip(names, new))}

    def change(self, step: int, key: Any, args: tuple) -> tuple | None:
        """``args`` as step ``step`` should see them, or None to leave them."""
        if step == self.step:
            old = self.prev.get(key)
            if old is None or len(old) != len(args):
                return None
            new = tuple(o if o is not None and _data(a) else a for o, a in zip(old, args))
            return new if any(x is not a for x, a in zip(new, args)) else None
        if step == self.step - 1 and key not in self.prev:
            # every data tensor: the features and what goes with them (a padding mask, token
            # ids, lengths), or a batch half replaced still carries what failed
            self.prev[key] = tuple(a.detach().clone() if _data(a) else None for a in args)
        return None

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.depth = max(0, self.depth - 1)

    def loss(self, name: str, original: Any) -> Any:
        """``torch.nn.functional.<name>`` with its target changed where :meth:`change` says,
        when called outside every module (a loss module's call was changed already)."""
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.depth or torch.compiler.is_compiling() or _in_backward():
                return original(*args, **kwargs)
            where = "target" if "target" in kwargs else 1 if len(args) > 1 else None
            if where is None:
                return original(*args, **kwargs)
            target = kwargs["target"] if where == "target" else args[1]
            step, kind, n = self.key(("loss", name))
            new = self.change(step, (kind, n), (target,))
            if new is not None and new[0] is not target:
                self.applied[self.spec].add(name)
                if where == "target":
                    kwargs = {**kwargs, "target": new[0]}
                else:
                    args = (args[0], new[0], *args[2:])
            return original(*args, **kwargs)

        return functools.wraps(original)(call)


class _SkipSamples(_SkipBatch):
    """Step ``step``'s outermost module calls, and the functional losses called outside every
    module, get their batch rows ``rows`` replaced by the batch's first other row, in every data
    tensor (no autograd history) with the batch's size as its first dimension: the size of the
    first such tensor of the step (the features and what goes with them: targets, masks, token
    ids, lengths; not a causal mask or a position table, whose first dimension is the
    sequence's)."""

    def __init__(self, step: int, rows: list[int], spec: str,
                 applied: dict[str, set[str]]) -> None:
        super().__init__(step, spec, applied)
        self.rows = rows
        self.size: int | None = None

    def change(self, step: int, key: Any, args: tuple) -> tuple | None:
        if step != self.step:
            return None
        out, changed = [], False
        for a in args:
            if _data(a) and a.dim() >= 1:
                if self.size is None and a.shape[0] > self.rows[-1]:
                    self.size = int(a.shape[0])
                good = next((i for i in range(a.shape[0]) if i not in self.rows), None)
                if a.shape[0] == self.size and good is not None:
                    a = a.clone()  # the script's tensor is left as it was
                    a[self.rows] = a[good].clone()
                    changed = True
            out.append(a)
        return tuple(out) if changed else None


def _skip(p: _Patches, skip: _SkipBatch) -> None:
    skip.stack = p.stack

    def without_ours(original: Any) -> Any:
        def __getstate__(self: nn.Module) -> Any:  # a pickled model carries no hook of ours
            state = original(self)
            if isinstance(state, dict) and skip.hook_ids:
                for table in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):
                    hooks = state.get(table)
                    if hooks and skip.hook_ids.intersection(hooks):
                        state[table] = type(hooks)(
                            (k, v) for k, v in hooks.items() if k not in skip.hook_ids)
            return state

        return __getstate__

    p.patch(nn.Module, "__getstate__", without_ours)
    p.stack.enter_context(_M.register_module_forward_pre_hook(skip.pre))
    p.stack.enter_context(_M.register_module_forward_hook(skip.post, always_call=True))
    p.stack.enter_context(_O.register_optimizer_step_post_hook(skip.optimizer_step))
    for name in LOSS_FUNCTIONS:
        if name in vars(F):
            p.patch(F, name, functools.partial(skip.loss, name))


def _float32_lines(spec: FixSpec, applied: dict[str, set[str]]) -> Any:
    """``fp32-lines``: the snippet's own helper (:data:`nanhunt.fixspec.FP32_LINES_HELPER`),
    run here, so the installed fix is the printed code; ``applied`` records that an op on
    the lines ran."""
    namespace: dict[str, Any] = {}
    exec(compile(FP32_LINES_HELPER, "<nanhunt fp32-lines>", "exec"), namespace)
    first, _, last = (spec.op or "").partition("-")
    seen = applied.setdefault(str(spec), set())

    class Watched(namespace["Float32Lines"]):  # type: ignore[misc, valid-type]
        def _on_the_lines(self) -> bool:
            on = super()._on_the_lines()
            if on:
                seen.add("lines")
            return on

    return Watched(spec.patterns[0], int(first), int(last or first))


def install(specs: list[FixSpec], stack: contextlib.ExitStack,
            applied: dict[str, set[str]]) -> None:
    """Install the whole-program specs among ``specs`` onto ``stack``."""
    p = _Patches(stack, applied)
    for spec in specs:
        if spec.kind == "fp32-all":
            _precision(p, str(spec), None)
            _no_scaler(p, str(spec))
            _compression(p, str(spec), None)
        elif spec.kind == "bf16":
            _precision(p, str(spec), torch.bfloat16)
            _compression(p, str(spec), torch.bfloat16)
        elif spec.kind == "no-scaler":
            _no_scaler(p, str(spec))
        elif spec.kind == "fp32-lines":
            stack.enter_context(_float32_lines(spec, applied))
        elif spec.kind == "skip-samples":
            _skip(p, _SkipSamples(int(spec.value or 0), sample_rows(spec), str(spec), applied))
        elif spec.kind == "skip-batch":
            _skip(p, _SkipBatch(int(spec.value or 0), str(spec), applied))
