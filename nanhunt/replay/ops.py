"""Op recording: a :class:`TorchDispatchMode` that sees every aten op of a replay, forward and
backward, records each op's output range and names the first op that produced a non-finite
value, with the user's source line that called it (or torch's optimizer line)."""

from __future__ import annotations

import contextlib
import linecache
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanhunt._paths import PACKAGE_DIR
from nanhunt.capture._util import tensor_leaves
from nanhunt.trace import OpRecord

__all__ = ["OpRecorder", "OptimizerOpRecorder", "ReplayResult", "StepLocator"]

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_OUR_DIR = str(Path(PACKAGE_DIR).resolve())
_MAX_OPS = 400
_MASK_OPS = {f"aten.{n}" for n in ("masked_fill", "masked_fill_", "fill", "fill_", "full",
                                    "full_like", "where", "index_put", "index_put_", "scatter",
                                    "copy_", "_to_copy", "triu", "tril", "new_full")}
#: ops whose output is memory not yet written: whatever bits it holds (an inf by chance) are
#: no op's doing, and judging them made the named op change from run to run
_UNINITIALISED = {f"aten.{n}" for n in ("empty", "empty_like", "empty_strided", "new_empty",
                                        "new_empty_strided", "empty_permuted")}
# ops whose floor goes on the denominator, not the first argument
_FLOOR_ARG = {"div": 1, "remainder": 1, "fmod": 1}


@dataclass
class ReplayResult:
    ops: list[OpRecord] = field(default_factory=list)
    first: OpRecord | None = None
    outputs_finite: bool = True
    output_amax: float = 0.0
    grads_finite: bool | None = None
    error: str | None = None
    dropped_ops: int = 0


def _user_source(depth: int = 2) -> tuple[str | None, str | None]:
    """file:line and text of the innermost frame that is not torch's or nanhunt's, from
    ``depth`` frames out (2: the caller of the ``__torch_dispatch__`` that asks)."""
    frame = sys._getframe(depth)
    while frame is not None:
        fname = frame.f_code.co_filename
        if fname.startswith(_OUR_DIR):
            return None, None  # reached the replay itself: the op ran in torch's own code
        if not (fname.startswith(_TORCH_DIR) or fname.startswith("<")):
            line = linecache.getline(fname, frame.f_lineno).strip() or None
            return f"{fname}:{frame.f_lineno}", line
        frame = frame.f_back
    return None, None


_MODULE_CALL = ("_call_impl", "_wrapped_call_impl")


def _direct(depth: int = 2) -> bool:
    """Whether the op that asks was called on a user line itself (through torch's functions,
    not inside an ``nn.Module`` call the line made): no module call lies between it and the
    innermost frame outside torch."""
    frame = sys._getframe(depth)
    while frame is not None:
        fname = frame.f_code.co_filename
        if not (fname.startswith(_TORCH_DIR) or fname.startswith("<")):
            return True
        if frame.f_code.co_name in _MODULE_CALL:
            return False
        frame = frame.f_back
    return False


def _node_source() -> tuple[str | None, str | None]:
    """In backward: the forward call that created the running autograd node (anomaly mode)."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None, None
    stack = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
    if not stack:
        return None, None
    text = "".join(stack) if isinstance(stack, list) else str(stack)
    best = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            fname = line.split('"')[1]
            if fname.startswith(_OUR_DIR):
                best = None  # outermost first: frames before the replay's own are not in it
            elif not (fname.startswith(_TORCH_DIR)
                    or fname.startswith("<")):  # (<frozen runpy>: the interpreter's own)
                try:
                    lineno = int(line.split("line ")[1].split(",")[0])
                except (IndexError, ValueError):
                    continue
                best = (fname, lineno)
    if best is None:
        return None, None
    return f"{best[0]}:{best[1]}", linecache.getline(best[0], best[1]).strip() or None


class OpRecorder(TorchDispatchMode):
    """Record every aten op's output range; remember the first non-finite one."""

    def __init__(self, op_floor: tuple[str, float] | None = None) -> None:
        super().__init__()
        self.ops: list[OpRecord] = []
        self.first: OpRecord | None = None
        self.dropped = 0
        self.op_floor = op_floor  # (op name, minimum): floor that op's input (a fix)
        self.weak: OpRecord | None = None  # the first -inf from a mask-building op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.op_floor and torch._C._current_graph_task_id() == -1 and \
                str(getattr(func, "overloadpacket", "")) == f"aten.{self.op_floor[0]}":
            i = _FLOOR_ARG.get(self.op_floor[0], 0)
            if len(args) > i and isinstance(args[i], torch.Tensor) and \
                    args[i].is_floating_point():
                args = (*args[:i], args[i].clamp_min(self.op_floor[1]), *args[i + 1:])
        if str(getattr(func, "overloadpacket", "")) in _UNINITIALISED:
            return func(*args, **(kwargs or {}))
        # which kinds of non-finite value the inputs held, before the op (an in-place op
        # overwrites its input)
        ins: list = []
        tensor_leaves((args, kwargs or {}), "", ins)
        held = _kinds([t for _, t in ins if t.is_floating_point() and t.numel() > 0])
        input_inf = held[1] + held[2]
        out = func(*args, **(kwargs or {}))
        leaves: list = []
        tensor_leaves(out, "", leaves)
        floats = [t for _, t in leaves if t.is_floating_point() and t.numel() > 0]
        if not floats:
            return out
        amax, nonfinite, numel, zeros = 0.0, 0, 0, 0
        for t in floats:
            f = t.detach().float()
            fin = torch.isfinite(f)
            nonfinite += int((~fin).sum())
            numel += t.numel()
            zeros += int((f == 0).sum())
            if fin.any():
                amax = max(amax, float(f.abs().masked_fill(~fin, 0).amax()))
        made = _kinds(floats)
        # what the op made that its inputs did not hold: NaN or +inf is a failure (a NaN from
        # infinite inputs too: inf - inf, 0 x inf, a softmax over a row masked throughout); a
        # -inf alone is how masks are built (by masked_fill, full, where) unless another op
        # made it (log(0)); an op that only carried its inputs' values on made nothing
        nan, pos, neg = (made[i] > 0 and held[i] == 0 for i in range(3))
        strong = nan or pos
        backward = torch._C._current_graph_task_id() != -1
        source, line = _node_source() if backward else _user_source()
        name = str(getattr(func, "overloadpacket", func))
        rec = OpRecord(index=len(self.ops) + self.dropped, op=name,
                       phase="backward" if backward else "forward",
                       dtype=str(floats[0].dtype).removeprefix("torch."), amax=amax,
                       nonfinite=nonfinite, numel=numel, source=source,
                       scalars=_scalars(args, kwargs), zeros=zeros, input_inf=input_inf)
        if line:
            rec.source = f"{source}  {line}" if source else line
        if self.first is None and (strong or (neg and name not in _MASK_OPS)):
            rec.first_nonfinite = True
            self.first = rec
        elif neg and self.weak is None:
            self.weak = rec
        if len(self.ops) < _MAX_OPS or rec.first_nonfinite:
            self.ops.append(rec)
        else:
            self.dropped += 1
        return out


def _kinds(tensors: list) -> tuple[int, int, int]:
    """How many NaN, +inf and -inf values ``tensors`` hold."""
    nan = pos = neg = 0
    for t in tensors:
        f = t.detach()
        if bool(torch.isfinite(f).all()):
            continue
        nan += int(torch.isnan(f).sum())
        pos += int((f == math.inf).sum())
        neg += int((f == -math.inf).sum())
    return nan, pos, neg


def _scalars(args: tuple, kwargs: dict | None) -> list[float]:
    """The Python numbers an op was called with (an eps, a fill value, alpha), and one-element
    tensors that hold one: the constants a hand-written norm or mask brings to the op."""
    out: list[float] = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, float) or (isinstance(a, int) and not isinstance(a, bool)):
            out.append(float(a))
        elif isinstance(a, torch.Tensor) and a.numel() == 1 and a.dim() == 0 and \
                a.is_floating_point():
            out.append(float(a.detach().float()))
    return out[:4]


_OPTIM_DIR = str(Path(torch.optim.__file__).resolve().parent)


def _optimizer_source() -> str | None:
    """The line of torch's optimizer code running the op: ``adam.py:423  denom = ...``."""
    frame = sys._getframe(2)
    while frame is not None:
        fname = frame.f_code.co_filename
        if fname.startswith(_OUR_DIR):
            return None
        if fname.startswith(_OPTIM_DIR) and not fname.endswith(("optimizer.py", "_functional.py")):
            text = linecache.getline(fname, frame.f_lineno).strip()
            return f"torch/optim/{Path(fname).name}:{frame.f_lineno}  {text}"
        frame = frame.f_back
    return None


class OptimizerOpRecorder(OpRecorder):
    """The op recorder for an optimizer step: the source is torch's optimizer line."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        n = len(self.ops)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.ops) > n:
            rec = self.ops[-1]
            rec.phase = "optimizer"
            rec.source = _optimizer_source()
        return out


# ----------------------------------------------------------------------------- one step, live


def _innermost_outside_torch(depth: int) -> str | None:
    """The file of the innermost Python frame ``depth`` frames out or further that is not
    torch's (None: none, an op the autograd engine ran from C++)."""
    frame = sys._getframe(depth + 1)
    while frame is not None:
        fname = frame.f_code.co_filename
        if not (fname.startswith(_TORCH_DIR) or fname.startswith("<")):
            return fname
        frame = frame.f_back
    return None


def _finite(tensors: list) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class StepLocator(TorchDispatchMode):
    """Watches the script's own ops, live, for one step (entered at its start, left at its end):
    remembers the first op that made a non-finite value from finite floating inputs, with the
    user's source line (in backward: the forward line that made the node, where anomaly mode
    recorded one). Ops that nanhunt's own hooks run are not the script's and are passed by; a
    ``-inf`` built by a mask op is the first only where nothing stronger follows in the step.
    For re-runs (the control): it costs an isfinite per op input and output of that step."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step
        self.first: dict | None = None
        self.weak: dict | None = None  # a -inf from a mask-building op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.first is not None:
            return out
        with contextlib.suppress(Exception):  # never the script's problem
            self._check(func, args, kwargs, out)
        return out

    def _check(self, func, args, kwargs, out) -> None:
        if str(getattr(func, "overloadpacket", "")) in _UNINITIALISED:
            return
        leaves: list = []
        tensor_leaves(out, "", leaves)
        outs = [t for _, t in leaves if t.is_floating_point() and t.numel() > 0]
        if not outs or _finite(outs):
            return
        where = _innermost_outside_torch(2)  # past _check and __torch_dispatch__
        if where is not None and where.startswith(_OUR_DIR):
            return  # nanhunt's own statistics of a value that was already non-finite
        ins: list = []
        tensor_leaves((args, kwargs or {}), "", ins)
        inputs = [t for _, t in ins if t.is_floating_point() and t.numel() > 0]
        if not _finite(inputs):
            return  # it carried a non-finite value on: not where one was made
        name = str(getattr(func, "overloadpacket", func))
        strong = any(bool((torch.isnan(t) | (t == math.inf)).any()) for t in outs)
        backward = torch._C._current_graph_task_id() != -1
        source, line = _node_source() if backward else _user_source(3)  # past _check
        amax = max((float(t.detach().float().abs().amax()) for t in inputs), default=None)
        found = {"step": self.step, "op": name, "phase": "backward" if backward else "forward",
                 "dtype": str(outs[0].dtype).removeprefix("torch."), "source": source,
                 # written on that line, not inside a module the line calls
                 "direct": not backward and source is not None and _direct(3),
                 "source_line": line, "input_amax": amax,
                 "input_zeros": sum(int((t == 0).sum()) for t in inputs),
                 "nonfinite": sum(int((~torch.isfinite(t)).sum()) for t in outs),
                 "numel": sum(t.numel() for t in outs)}
        if strong or name not in _MASK_OPS:
            self.first = found
        elif self.weak is None:
            self.weak = found

    def found(self) -> dict | None:
        return self.first or self.weak

