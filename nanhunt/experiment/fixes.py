"""Install fixes from outside the training script, through global instrumentation.

:func:`install` takes parsed ``--fix`` specs (:mod:`nanhunt.fixspec`) and makes the
change each
snippet makes, without editing the script: global module pre/post hooks run a region in
float32, clamp an output, enter a :class:`TorchFunctionMode` that floors an op's input, or set a
norm's eps; a wrapper of ``Optimizer.__init__`` changes eps and the learning rate; a wrapper of
``GradScaler.__init__`` sets ``init_scale``; an optimizer step pre-hook clips the (unscaled)
gradients, swaps in float32 master weights or warms the learning rate up; a z-loss and a soft
cap on attention logits are :mod:`nanhunt.experiment.curve_fixes`. Hooks and patches are
removed, and patched methods restored to the exact objects, by :meth:`Fixes.uninstall`; what
the fixes changed in the model or optimizer (an eps, a learning rate, float32 weights) stays,
as with the snippet. A wrapper of DDP's ``register_comm_hook`` swaps or drops a compression
hook.

Modules are named as nanhunt's reports name them (qualified names from the model, a root that
is not the model by its variable name), so a module name from a report is a valid pattern.

>>> import torch
>>> from nanhunt.fixspec import parse_fix
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
>>> with install([parse_fix("clamp:0=1")]):
...     float(model(torch.full((1, 2), 100.0)).detach().abs().max())
1.0
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import inspect
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _M
from torch.optim import optimizer as _O
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from nanhunt import capture
from nanhunt._patching import patch
from nanhunt.capture.naming import Naming
from nanhunt.errors import NanhuntError
from nanhunt.experiment import rungs
from nanhunt.experiment.curve_fixes import SoftCap, Warmup, ZLoss
from nanhunt.experiment.rungs import FixMismatch
from nanhunt.fixspec import MODULE_KINDS, FixSpec, number

__all__ = ["FixMismatch", "Fixes", "RunFixes", "install"]

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_DISPATCH_FILES = (str(Path(_TORCH_DIR) / "overrides.py"), str(Path(_TORCH_DIR) / "_tensor.py"))
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")

# torch function name -> (floor op, index of the argument floored)
_FLOORED = {
    "log": ("log", 0), "log2": ("log2", 0), "log10": ("log10", 0), "sqrt": ("sqrt", 0),
    "rsqrt": ("rsqrt", 0), "reciprocal": ("reciprocal", 0),
    "div": ("div", 1), "true_divide": ("div", 1), "divide": ("div", 1),
    "__truediv__": ("div", 1), "__div__": ("div", 1), "__rtruediv__": ("div", 0),
    "__rdiv__": ("div", 0), "pow": ("pow", 0), "__pow__": ("pow", 0), "float_power": ("pow", 0),
}


@dataclass
class _Plan:
    """What the fixes do to one module's calls."""

    fp32: bool = False
    cast_back: bool = False
    clamp: float | None = None
    floors: dict[str, float] = field(default_factory=dict)
    eps: float | None = None
    zloss: float | None = None  # keep the output as logits of a z-loss with this coefficient
    cap: float | None = None  # soft-cap the softmax inputs inside at this value

    @property
    def empty(self) -> bool:
        return not (self.fp32 or self.clamp is not None or self.floors or self.eps is not None
                    or self.zloss is not None or self.cap is not None)


class _FloorMode(TorchFunctionMode):
    """Floor the input of chosen ops that the user's code calls (not torch's own internals)."""

    def __init__(self, floors: dict[str, float]) -> None:
        super().__init__()
        self.floors = floors

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        hit = _FLOORED.get(getattr(func, "__name__", ""))
        if hit is not None and hit[0] in self.floors and _called_by_user():
            i = hit[1]
            if len(args) > i and isinstance(args[i], torch.Tensor) and \
                    args[i].is_floating_point():
                args = (*args[:i], args[i].clamp_min(self.floors[hit[0]]), *args[i + 1:])
        return func(*args, **kwargs)


def _called_by_user() -> bool:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _DISPATCH_FILES:
        frame = frame.f_back
    return frame is None or not frame.f_code.co_filename.startswith(_TORCH_DIR)


def _up(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _call_kwargs() -> dict | None:
    """The kwargs dict of the module call whose global pre-hook is running: global pre-hooks
    get no kwargs, but the float32 region casts keyword tensors up too (as the snippet does)."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        if frame.f_code.co_filename == _M.__file__ and frame.f_code.co_name in (
                "inner", "_call_impl"):
            kwargs = frame.f_locals.get("kwargs")
            return kwargs if isinstance(kwargs, dict) else None
        frame = frame.f_back
    return None


class _Names:
    """Module -> qualified name by the one rule capture names them with
    (:class:`nanhunt.capture.naming.Naming`), so a ``--fix`` pattern matches exactly the names
    a report printed: the first root with parameters is the model (names as in
    ``model.named_modules()``), other roots by variable, wrappers (DDP) by their inner model."""

    def __init__(self) -> None:
        self.naming = Naming()

    @property
    def all(self) -> list[str]:
        return list(self.naming.types)

    @property
    def of(self) -> WeakIdKeyDictionary:
        return self.naming.names

    def name(self, module: nn.Module, outermost: bool) -> str | None:
        name = self.naming.names.get(module)
        if name is not None or outermost:
            return name if name is not None else self.naming.name_of(module, [])
        for ref, label in list(self.naming.roots):  # created after its root was named
            root = ref()
            if root is not None and any(m is module for m in root.modules()):
                self.naming.add_root(root, label=label)
                return self.naming.names.get(module)
        return None


class Fixes:
    """Installed fixes; use :func:`install`. ``applied`` lists what each spec changed."""

    def __init__(self, specs: Iterable[FixSpec]) -> None:
        self.specs = list(specs)
        self.applied: dict[str, set[str]] = {str(s): set() for s in self.specs}
        self._names = _Names()
        self._plans: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._stack: contextlib.ExitStack | None = None
        self._calls: list[tuple[nn.Module, list[Any], bool, torch.dtype | None]] = []
        self._depth = 0
        self._low: torch.dtype | None = None  # the half dtype a region's output goes back to
        self._masters: dict[Any, torch.Tensor] = {}
        self._swapped: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        self._checked = False
        self._optimizers = 0
        self._scalers = 0
        #: what the run showed about the fixes that the report should say (a schedule that
        #: sets the learning rate itself)
        self.notes: list[str] = []
        self._lr_factor = next((s.value for s in self.specs if s.kind == "lr-factor"), None)
        # lr-factor: id(param group) -> (the group, the lr the factor left there); the groups
        # whose lr the script sets itself get the factor before every step, their own value back
        # after it
        self._lr_left: dict[int, tuple[dict, Any]] = {}
        self._lr_script: set[int] = set()
        self._lr_restore: list[tuple[dict, Any]] = []
        self._step_ends = 0
        self._skips = [s for s in self.specs if s.kind in ("skip-batch", "skip-samples")]
        self._comm_hook = next((s for s in self.specs if s.kind == "comm-hook"), None)
        self._comm_hooks_registered = 0
        kinds = {s.kind for s in self.specs}
        self._module_specs = [s for s in self.specs if s.patterns and s.kind in MODULE_KINDS]
        self._optimizer_specs = kinds & {"opt-eps", "lr-factor", "clip", "fp32-master", "warmup"}
        warm = next((s.value for s in self.specs if s.kind == "warmup"), None)
        self._warmup = Warmup(int(warm)) if warm else None
        self._zloss = ZLoss(FixMismatch) if "zloss" in kinds else None
        self._capped = [0]  # softmax calls a cap reached
        self._scaler_args = {
            "init_scale": next((s.value for s in self.specs if s.kind == "init-scale"), None),
            "growth_interval": next((int(s.value or 0) for s in self.specs
                                     if s.kind == "growth-interval"), None),
        }

    # -- install / uninstall --------------------------------------------------------------

    def install(self) -> Fixes:
        if capture._ACTIVE is not None:
            raise NanhuntError("install fixes before starting a nanhunt session")
        with contextlib.ExitStack() as stack:
            if self._module_specs:
                stack.enter_context(_M.register_module_forward_pre_hook(self._pre))
                stack.enter_context(_M.register_module_forward_hook(self._post, always_call=True))
                stack.callback(self._close_calls)
            if self._optimizer_specs:
                self._patch(stack, torch.optim.Optimizer, "__init__", self._wrap_optimizer_init)
            if self._optimizer_specs or self._module_specs:
                stack.enter_context(_O.register_optimizer_step_pre_hook(self._opt_pre))
            if self._optimizer_specs & {"fp32-master", "lr-factor", "warmup"}:
                stack.enter_context(_O.register_optimizer_step_post_hook(self._opt_post))
            if any(v is not None for v in self._scaler_args.values()):
                self._patch(stack, torch.amp.GradScaler, "__init__", self._wrap_scaler_init)
            if self._zloss is not None:
                self._zloss.install(stack)
            if self._comm_hook is not None:
                ddp = _ddp_class()
                if ddp is not None:
                    self._patch(stack, ddp, "register_comm_hook", self._wrap_register_comm_hook)
            rungs.install([s for s in self.specs if s.kind in rungs.GLOBAL_KINDS], stack,
                          self.applied)
            self._stack = stack.pop_all()
        return self

    def uninstall(self, *, completed: bool = True) -> str | None:
        """Remove every hook and patch; the message of a fix that never applied, if any (only
        judged when the run ``completed``: one stopped early may not have reached it)."""
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        return self.mismatch(final=True) if completed else None

    def __enter__(self) -> Fixes:
        return self if self._stack is not None else self.install()

    def __exit__(self, *exc: object) -> bool:
        self.uninstall()
        return False

    _patch = staticmethod(patch)

    def _close_calls(self) -> None:
        """Leave what a call interrupted by a BaseException (Ctrl-C, the run stopped) left
        entered: the autocast state and the function mode stack are the process's."""
        while self._calls:
            for ctx in reversed(self._calls.pop()[1]):
                ctx.__exit__(None, None, None)

    # -- matching -------------------------------------------------------------------------

    def mismatch(self, *, final: bool = False) -> str | None:
        """Why a spec does not apply, once the model is known (its first optimizer step, or
        the end of the run)."""
        for spec in self._module_specs:
            for pattern in spec.patterns:
                if not any(fnmatch.fnmatchcase(n, pattern) for n in self._names.all):
                    if not self._names.all and not final:
                        continue
                    close = difflib.get_close_matches(pattern, self._names.all, n=2)
                    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
                    if not self._names.all:
                        hint = " (no module ran)"
                    return f"--fix {spec}: {pattern!r} matches no module of the model{hint}"
        for spec in self.specs:
            if final and spec.kind == "fp32-lines" and not self.applied[str(spec)]:
                return (f"--fix {spec}: no torch op ran on those lines of a file named like "
                        f"{spec.patterns[0]!r}")
            if spec.kind in ("skip-batch", "skip-samples") and not self.applied[str(spec)] \
                    and (final or self._step_ends > (spec.value or 0)):
                return (f"--fix {spec}: nothing was replaced: no module call or functional "
                        "loss outside one got batch tensors "
                        f"to replace at step {number(spec.value)}")
        if final and self._optimizer_specs and not self._optimizers:
            return self._no_optimizer()
        if final and any(v is not None for v in self._scaler_args.values()) and \
                not self._scalers:
            return "--fix init-scale/growth-interval: the script made no GradScaler"
        if final and self._comm_hook is not None and not self._comm_hooks_registered:
            return (f"--fix {self._comm_hook}: the script registered no DDP communication hook "
                    "(register_comm_hook)")
        return None

    def _plan(self, module: nn.Module, name: str) -> _Plan:
        plan = _Plan()
        prefixes = [name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)]
        for spec in self._module_specs:
            if spec.kind == "fp32":
                for i, pattern in enumerate(spec.patterns):
                    # as the snippet: a module inside one this pattern runs in float32 already
                    if fnmatch.fnmatchcase(name, pattern) and not any(
                            fnmatch.fnmatchcase(p, pattern) for p in prefixes):
                        plan.fp32 = True
                        plan.cast_back |= i >= len(spec.starts)
                        self.applied[str(spec)].add(name)
                continue
            if not fnmatch.fnmatchcase(name, spec.patterns[0]):
                continue
            self.applied[str(spec)].add(name)
            if spec.kind == "clamp":
                plan.clamp = spec.value
            elif spec.kind == "floor":
                plan.floors[str(spec.op)] = float(spec.value or 0.0)
            elif spec.kind == "eps":
                if not any(hasattr(module, a) for a in _EPS_ATTRS):
                    raise FixMismatch(f"--fix {spec}: {name} ({type(module).__name__}) has no "
                                      "eps attribute")
                plan.eps = spec.value
            elif spec.kind == "zloss":
                plan.zloss = spec.value
            elif spec.kind == "cap":
                plan.cap = spec.value
        return plan

    # -- module hooks ---------------------------------------------------------------------

    def _pre(self, module: nn.Module, args: tuple) -> Any:
        if torch.compiler.is_compiling():
            return None
        outermost = self._depth == 0
        self._depth += 1
        plan = self._plans.get(module)
        if plan is None:
            name = self._names.name(module, outermost)
            if name is None:
                self._calls.append((module, [], False, None))
                return None
            plan = self._plans[module] = self._plan(module, name)
            if plan.eps is not None:
                for attr in _EPS_ATTRS:
                    if hasattr(module, attr):
                        setattr(module, attr, plan.eps)
            if plan.fp32:
                module.float()
        entered: list[Any] = []
        low = None
        if plan.fp32:
            device = _device_of(module, args)
            if torch.is_autocast_enabled(device):
                low = torch.get_autocast_dtype(device)
            ctx = torch.autocast(device, enabled=False)
            ctx.__enter__()
            entered.append(ctx)
            for a in args:
                if isinstance(a, torch.Tensor) and a.is_floating_point() and \
                        a.dtype != torch.float32:
                    self._low = a.dtype
                    break
            kwargs = _call_kwargs()
            if kwargs:
                for k, v in kwargs.items():
                    kwargs[k] = _up(v)
            args = tuple(_up(a) for a in args)
        if plan.floors:
            mode = _FloorMode(plan.floors)
            mode.__enter__()
            entered.append(mode)
        if plan.cap is not None:
            entered.append(SoftCap(plan.cap, self._capped).__enter__())
        self._calls.append((module, entered, plan.cast_back, low or self._low))
        return args if plan.fp32 else None

    def _post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if torch.compiler.is_compiling() or not self._calls:
            return None
        self._depth = max(0, self._depth - 1)
        if self._calls[-1][0] is not module:
            return None
        _, entered, cast_back, low = self._calls.pop()
        for ctx in reversed(entered):
            ctx.__exit__(None, None, None)
        plan = self._plans.get(module)
        if plan is None:
            return None
        if cast_back and low is not None:
            def down(x: Any) -> Any:
                return x.to(low) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

            output = tuple(map(down, output)) if type(output) is tuple else down(output)
        if plan.clamp is not None:
            if not isinstance(output, torch.Tensor):
                raise FixMismatch(f"--fix clamp: {self._names.of.get(module)} returns a "
                                  f"{type(output).__name__}, not a tensor")
            output = output.clamp(-plan.clamp, plan.clamp)
        if plan.zloss is not None and self._zloss is not None:
            self._zloss.keep(output, plan.zloss)
        return output

    # -- optimizer and scaler -------------------------------------------------------------

    def _wrap_optimizer_init(self, original: Any) -> Any:
        fixes = self

        def __init__(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            original(optimizer, *args, **kwargs)
            fixes._optimizers += 1
            for spec in fixes.specs:
                if spec.kind == "opt-eps":
                    groups = [g for g in optimizer.param_groups if "eps" in g]
                    if not groups:
                        raise FixMismatch(f"--fix {spec}: {type(optimizer).__name__} has no eps")
                    for g in groups:
                        g["eps"] = spec.value
                    fixes.applied[str(spec)].add(type(optimizer).__name__)
                elif spec.kind == "lr-factor":
                    for g in optimizer.param_groups:
                        g["lr"] *= spec.value
                        fixes._lr_left[id(g)] = (g, g["lr"])
                    fixes.applied[str(spec)].add(type(optimizer).__name__)

        return __init__

    def _wrap_scaler_init(self, original: Any) -> Any:
        fixes = self
        signature = inspect.signature(original)

        def __init__(scaler: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(scaler, *args, **kwargs)
            for arg, value in fixes._scaler_args.items():
                if value is not None:
                    bound.arguments[arg] = value
            fixes._scalers += 1
            for spec in fixes.specs:
                if spec.kind in ("init-scale", "growth-interval"):
                    fixes.applied[str(spec)].add("GradScaler")
            original(*bound.args, **bound.kwargs)

        return __init__

    def _wrap_register_comm_hook(self, original: Any) -> Any:
        """comm-hook:bf16 registers bf16_compress_hook where the script registers
        fp16_compress_hook; comm-hook:none registers nothing (DDP's own all-reduce)."""
        fixes = self
        spec = self._comm_hook

        def register_comm_hook(ddp: Any, state: Any, hook: Any) -> Any:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            fixes._comm_hooks_registered += 1
            name = getattr(hook, "__name__", type(hook).__name__)
            fixes.applied[str(spec)].add(name)
            if spec.op == "none":
                return None
            if hook is not default_hooks.fp16_compress_hook:
                raise FixMismatch(f"--fix {spec}: the script registers {name}, not "
                                  "fp16_compress_hook (use comm-hook:none)")
            try:
                return original(ddp, state, default_hooks.bf16_compress_hook)
            except TypeError as exc:  # DDP refuses it: CUDA 11+ and NCCL 2.10+, or XPU, only
                raise FixMismatch(f"--fix {spec}: {exc}; use comm-hook:none") from None

        return register_comm_hook

    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizers = max(self._optimizers, 1)
        if not self._checked:
            self._checked = True
            message = self.mismatch()
            if message:
                raise FixMismatch(message)
        if self._lr_factor is not None:
            self._lr_factor_now(optimizer)
        if self._warmup is not None:
            self._warmup.before(optimizer)  # after lr-factor: it scales the factored lr
            self.applied[f"warmup={self._warmup.steps}"].add(type(optimizer).__name__)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for spec in self.specs:
            if spec.kind == "clip":
                torch.nn.utils.clip_grad_norm_(params, max_norm=spec.value)
                self.applied[str(spec)].add(type(optimizer).__name__)
        if "fp32-master" in self._optimizer_specs:
            self._swap_in_masters(params)

    def _lr_factor_now(self, optimizer: Any) -> None:
        """lr-factor where the script sets the learning rate itself between steps (a
        hand-written schedule of absolute values, as nanoGPT's ``param_group['lr'] = lr``): the
        factor applied when the optimizer was made is gone, so it multiplies the value the
        script set for this step, and the script gets its own value back after the step (its
        schedule, prints and checkpoints see what they set). A torch LR scheduler works from
        the factored ``initial_lr``: left alone."""
        f = self._lr_factor
        for g in optimizer.param_groups:
            key = id(g)
            if key not in self._lr_script:
                left = self._lr_left.get(key)
                if left is None or left[0] is not g:
                    continue  # a group added after the optimizer was made: as the snippet
                if "initial_lr" in g or g["lr"] is left[1] or (
                        not isinstance(g["lr"], torch.Tensor) and g["lr"] == left[1]):
                    self._lr_left[key] = (g, g["lr"])
                    continue
                self._lr_script.add(key)
                self.notes.append(
                    f"--fix lr-factor={number(f)}: the script sets the learning rate itself "
                    f"(before step {self._step_ends}: {_lr_text(g['lr'])}, where the factor had "
                    f"left {_lr_text(left[1])}), so the factor multiplies the value the script "
                    "sets before every optimizer step; the script still sees its own values")
            script_lr = g["lr"]
            g["lr"] = script_lr * f
            self._lr_restore.append((g, script_lr))

    def step_ended(self, trained: bool) -> None:
        """A training step ended (``trained``: it ran a backward). An optimizer fix on a script
        that made no torch optimizer by then cannot act: refuse it now rather than let the
        script train on unchanged."""
        self._step_ends += 1
        if trained and self._optimizer_specs and not self._optimizers:
            raise FixMismatch(self._no_optimizer())
        if self._skips and self._step_ends > max(int(s.value or 0) for s in self._skips):
            message = self.mismatch()  # a batch rung past its step that replaced nothing
            if message is not None:
                raise FixMismatch(message)
        if self._zloss is not None and trained:
            if self._zloss.pending and not self._zloss.added:
                spec = next(s for s in self.specs if s.kind == "zloss")
                raise FixMismatch(
                    f"--fix {spec}: the output of {', '.join(sorted(self.applied[str(spec)]))} "
                    "reached no F.cross_entropy or F.nll_loss (nn.CrossEntropyLoss, "
                    "nn.NLLLoss) in this step: add the z term to the script's own loss (the "
                    "snippet)")
            self._zloss.pending.clear()
        cap = next((s for s in self.specs if s.kind == "cap"), None)
        if cap is not None and trained and self.applied[str(cap)] and not self._capped[0]:
            raise FixMismatch(
                f"--fix {cap}: {', '.join(sorted(self.applied[str(cap)]))} called no softmax "
                "(torch.softmax, F.softmax, Tensor.softmax) in this step; a fused "
                "F.scaled_dot_product_attention computes its softmax where no cap can reach it")

    def _no_optimizer(self) -> str:
        specs = ", ".join(str(s) for s in self.specs
                          if s.kind in ("opt-eps", "lr-factor", "clip", "fp32-master", "warmup"))
        return (f"--fix {specs}: the script trains with no torch optimizer (it updates its "
                "weights itself), and this fix acts through one; change the script's own "
                "update instead")

    def _swap_in_masters(self, params: list) -> None:
        if all(p.dtype == torch.float32 for p in params):
            raise FixMismatch("--fix fp32-master: the optimizer's parameters are float32 already")
        self.applied["fp32-master"].add("optimizer")
        for p in params:
            if p.grad is None or p.dtype == torch.float32:
                continue
            master = self._masters.setdefault(p, p.detach().float())
            half, grad = p.data, p.grad
            p.grad = None
            p.data = master
            p.grad = grad.float()
            self._swapped.append((p, half, grad))

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._warmup is not None:
            self._warmup.after(optimizer)
        for g, script_lr in self._lr_restore:
            g["lr"] = script_lr
        self._lr_restore = []
        for p, half, grad in self._swapped:
            half.copy_(p.data)
            p.grad = None
            p.data = half
            p.grad = grad
        self._swapped = []


def _ddp_class() -> Any:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except Exception:  # a torch without distributed
        return None
    return DistributedDataParallel


def _lr_text(lr: Any) -> str:
    return number(float(lr)) if not isinstance(lr, torch.Tensor) or lr.numel() == 1 else "?"


def _device_of(module: nn.Module, args: tuple) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    p = next(module.parameters(), None)
    return p.device.type if p is not None else "cpu"


def install(specs: Iterable[FixSpec]) -> Fixes:
    """Install ``specs`` for the code that runs next; a context manager, or call
    :meth:`Fixes.uninstall` when done."""
    return Fixes(specs).install()


class RunFixes:
    """What ``nanhunt diagnose --fix`` installs around the script: the fixes, and in a
    verification re-run the sandbox for its writes and a progress file for the parent's
    live line."""

    def __init__(self, texts: Iterable[str]) -> None:
        from nanhunt.fixspec import parse_fix

        self.texts = list(texts)
        self.fixes = Fixes([parse_fix(t) for t in self.texts]) if self.texts else None
        self.sandbox: Any = None
        self._progress = os.environ.get("NANHUNT_PROGRESS") if \
            os.environ.get("NANHUNT_RERUN") == "1" else None

    @property
    def rerun(self) -> bool:
        """A verification re-run, judged by its steps alone (no replay, report.json only). The
        launcher's locating re-run (``NANHUNT_LOCATING=1``) is sandboxed like one but analysed
        in full: its origin is the point."""
        return os.environ.get("NANHUNT_RERUN") == "1" and \
            os.environ.get("NANHUNT_LOCATING") != "1"

    def install(self) -> RunFixes:
        from nanhunt.experiment import sandbox

        if self.fixes is not None:
            self.fixes.install()
        if os.environ.get("NANHUNT_RERUN") == "1":  # a verification or a locating re-run
            self.sandbox = sandbox.install()
        return self

    def uninstall(self, *, completed: bool = True) -> str | None:
        message = self.fixes.uninstall(completed=completed) if self.fixes is not None else None
        if self.sandbox is not None:
            self.sandbox.uninstall()
        return message

    @property
    def notes(self) -> list[str]:
        return self.fixes.notes if self.fixes is not None else []

    def amend(self, trace: Any) -> None:
        """Put what the run showed about the fixes into its report's notes."""
        trace.notes.extend(n for n in self.notes if n not in trace.notes)

    def on_step(self, rec: Any, trained: bool = True) -> None:
        if self.fixes is not None:
            self.fixes.step_ended(trained)
        if self._progress:
            loss = f"  loss {rec.loss:.4g}" if rec.loss is not None else ""
            with open(self._progress, "a", encoding="utf-8") as f:
                f.write(f"step {rec.index}{loss}{'  skipped' if rec.skipped else ''}\n")
