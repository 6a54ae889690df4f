"""Small torch helpers shared by the capture parts: tensor trees, autocast state, names."""

from __future__ import annotations

import dataclasses
import functools
import linecache
import math
import sys
import sysconfig
import types
from typing import Any

import torch
from torch import nn

from nanhunt import stats as _stats
from nanhunt._patching import patch  # noqa: F401 (the capture observers import it from here)
from nanhunt._paths import PACKAGE_DIR


def _safe(method: Any) -> Any:
    """A hook method whose exceptions (bugs of ours) stop tracing but never the user's run;
    StopRun, a BaseException, passes."""

    @functools.wraps(method)
    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
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
    tensors = [_stats.local(t) for t in tensors]  # a DTensor's local shard
    try:
        return torch._foreach_norm(tensors, ord, dtype=torch.float32)
    except (TypeError, RuntimeError):  # older torch: no dtype argument
        return tuple(t.detach().float().norm(ord) for t in tensors)


def _foreach_amax(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's largest |x| as float64 on their (one) device: NaN when it holds a NaN,
    inf when an inf. On a CPU one aminmax pass per tensor (the CPU's inf-norm kernel is about
    15x slower); elsewhere one fused norm kernel."""
    tensors = [_stats.local(t) for t in tensors]  # a DTensor's local shard
    if tensors and tensors[0].device.type == "cpu":
        lo, hi = [], []
        for t in tensors:
            if t.numel() == 0:
                lo.append(t.new_zeros(()))
                hi.append(t.new_zeros(()))
                continue
            mn, mx = torch.aminmax(t.detach())
            lo.append(mn)
            hi.append(mx)
        return torch.maximum(torch.stack(hi).double(), -torch.stack(lo).double())
    return torch.stack(_foreach_norm(tensors, math.inf)).double()


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
    # the user's own frames first: a framework's locals (Lightning's ``pl_module``) name the
    # model only when no frame of the user's code holds it
    for user_only in (True, False):
        frame = sys._getframe(1)
        while frame is not None:
            fname = frame.f_code.co_filename
            if not fname.startswith(_THIS_PACKAGE_DIR) and not (
                    user_only and fname.startswith(_LIBRARY_DIRS)):
                for k, v in frame.f_locals.items():
                    if v is obj and k != "self" and not k.startswith("_"):
                        return k
            frame = frame.f_back
    return None


def _variable_path(obj: object) -> str | None:
    """How the script's module-level code refers to ``obj``: a global of ``__main__``
    (``optimizer``), else an attribute of one (``trainer.optimizer``). Frames are not searched:
    reading a running frame's locals keeps them alive in Python 3.11 (the model, after the
    script dropped it)."""
    main = sys.modules.get("__main__")
    names = vars(main) if main else {}
    for k, v in names.items():
        if v is obj and not k.startswith("_"):
            return k
    for k, v in names.items():
        if k.startswith("_") or isinstance(v, (type, types.ModuleType, types.FunctionType)):
            continue
        attrs = getattr(v, "__dict__", None)
        if isinstance(attrs, dict):
            for attr, value in attrs.items():
                if value is obj and not attr.startswith("_"):
                    return f"{k}.{attr}"
    return None


# our frames are skipped when looking for the user's variables: the whole nanhunt package
_THIS_PACKAGE_DIR = PACKAGE_DIR
_TORCH_DIR = torch.__file__.rsplit("/", 1)[0]
#: where installed packages live (frameworks included): not the user's code
_LIBRARY_DIRS = tuple(sorted({p for p in (sysconfig.get_paths().get("purelib"),
                                          sysconfig.get_paths().get("platlib"),
                                          _TORCH_DIR) if p}))


def user_frame() -> tuple[str | None, str | None]:
    """``("train.py:57", "optimizer.step()")``: the innermost calling frame that is the user's
    code (not torch's, nanhunt's or the interpreter's), where a training-loop call was made."""
    frame = sys._getframe(1)
    while frame is not None:
        fname = frame.f_code.co_filename
        if not (fname.startswith(_THIS_PACKAGE_DIR) or fname.startswith(_TORCH_DIR)
                or fname.startswith("<")):
            return f"{fname}:{frame.f_lineno}", linecache.getline(fname, frame.f_lineno).strip()
        frame = frame.f_back
    return None, None


def module_caller() -> tuple[str, int, str] | None:
    """``(file, line, text)`` of the code calling the module whose hook runs now: the first
    frame outside nanhunt's hooks and torch's module machinery; None when that is nanhunt's
    own code (a replay) or no source file (the interpreter's)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_THIS_PACKAGE_DIR):
        frame = frame.f_back  # the hook itself
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back  # Module.__call__
    if frame is None:
        return None
    fname = frame.f_code.co_filename
    if fname.startswith(_THIS_PACKAGE_DIR) or fname.startswith("<"):
        return None
    return fname, frame.f_lineno, linecache.getline(fname, frame.f_lineno).strip()


def is_library_file(fname: str) -> bool:
    """torch's or nanhunt's own code: never the line a report names as the user's."""
    return fname.startswith((_THIS_PACKAGE_DIR, _TORCH_DIR))


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



def _clone_tree(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.detach().clone())

