"""Rules for causes outside the failing module's own arithmetic. Torch-free.

The training loop (a crash GradScaler raises when it is called in the wrong order), a constant
that does not fit the tensor's format (``masked_fill(mask, -1e9)`` on float16), an eps that
rounds to zero in the format it is added in (a hand-written norm's ``x + 1e-12``), and a batch
far outside a normalised range whose first layer overflows. They register in
:data:`nanhunt.analyse.diagnose.RULES` like every other rule;
:mod:`nanhunt.analyse.diagnose` imports this
module so that they are always there.

>>> from nanhunt.formats import get_format
>>> rounded(1e-8, get_format("float16")), rounded(1e-5, get_format("float16"))
(0.0, 1.0013580322265625e-05)
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from nanhunt.analyse.diagnose._base import Context, _finding, eps_in_format, is_norm_type, rule
from nanhunt.analyse.diagnose.classify import _forward_class
from nanhunt.analyse.diagnose.shared import (
    op_name,
    rounded,
    short_source,
    vanished_eps,
)
from nanhunt.errors import NanhuntError
from nanhunt.formats import NumberFormat, get_format
from nanhunt.trace import Crash, Failure, Finding, InputRange, Trace

__all__ = [
    "SCALER_ERRORS",
    "RangeConstant",
    "dtype_expr",
    "find_constants",
    "finfo_fix",
    "rounded",
    "scaler_error",
]


def _becomes(x: float, fmt: NumberFormat) -> str:
    r = rounded(x, fmt)
    if r == 0:
        return "0"
    return f"{r:.4g} ({eps_in_format(x, fmt)})"


# ----------------------------------------------------------------------------- GradScaler crashes

#: GradScaler's own errors (torch/amp/grad_scaler.py) -> (code, what the loop did, the fix).
SCALER_ERRORS: dict[str, tuple[str, str, str]] = {
    "step() has already been called since the last update()": (
        "step_without_update",
        "scaler.step(optimizer) ran again without scaler.update() after the previous one",
        "call scaler.update() once after every scaler.step(optimizer): it resets GradScaler's "
        "per-step state and backs the scale off after a skipped step",
    ),
    "unscale_() has already been called on this optimizer since the last update()": (
        "unscale_twice",
        "scaler.unscale_(optimizer) ran a second time in one step (it may run once, before "
        "clipping or inspecting the gradients)",
        "call scaler.unscale_(optimizer) once per step, after the last backward and before "
        "clipping; scaler.step(optimizer) does not unscale again",
    ),
    "unscale_() is being called after step()": (
        "unscale_after_step",
        "scaler.unscale_(optimizer) ran after scaler.step(optimizer) in the same step",
        "call scaler.unscale_(optimizer) before scaler.step(optimizer), or not at all",
    ),
    "No inf checks were recorded prior to update.": (
        "update_without_step",
        "scaler.update() ran without scaler.step(optimizer) before it: the optimizer was "
        "stepped directly (optimizer.step()) on gradients still multiplied by the scale",
        "call scaler.step(optimizer) instead of optimizer.step(), then scaler.update()",
    ),
    "No inf checks were recorded for this optimizer.": (
        "step_without_scaled_backward",
        "scaler.step(optimizer) ran on an optimizer whose gradients no scaled backward made "
        "(no gradients, or loss.backward() instead of scaler.scale(loss).backward())",
        "call scaler.scale(loss).backward() before scaler.step(optimizer)",
    ),
}


def scaler_error(message: str) -> tuple[str, str, str] | None:
    """(code, what happened, fix) when ``message`` is one of GradScaler's order errors."""
    for text, entry in SCALER_ERRORS.items():
        if text in message:
            return entry
    return None


def _at(crash: Crash) -> str:
    """`` at train.py:57 (`scaler.step(optimizer)`)``; the evidence has the full path."""
    if not crash.source:
        return ""
    text = f" at {short_source(crash.source)}"
    return text + (f" (`{crash.source_line}`)" if crash.source_line else "")


@rule(id="scaler-crash", kind="loss_scale")
def scaler_crash(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """The script crashed with GradScaler's own error: its calls ran in the wrong order."""
    crash = trace.crash
    found = scaler_error(crash.message) if crash is not None else None
    if crash is None or found is None:
        return
    code, what, fix = found
    evidence = [f"the script raised {crash.type}: {crash.message}"]
    if crash.source:
        evidence.append(f"raised by the call at {crash.source}: {crash.source_line or ''}".strip())
    if crash.step is not None:
        evidence.append(f"at step {crash.step}")
    yield _finding(
        "error",
        f"{what}{_at(crash)}: {fix}",
        evidence,
        phase="loss_scaling",
        step=crash.step,
        data={"misuse": code, "source": crash.source, "source_line": crash.source_line},
    )


# ----------------------------------------------------------------------------- range constants

_RANGE_ERROR = re.compile(r"value cannot be converted to type (?:c10|at)::(\w+) without overflow")

#: c10 scalar type names -> nanhunt's format names.
_C10_TYPES = {
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Float8_e4m3fn": "float8_e4m3fn",
    "Float8_e5m2": "float8_e5m2",
    "float": "float32",
}


@dataclass(frozen=True)
class RangeConstant:
    """A numeric literal in a line of code and the text it is written as."""

    value: float
    text: str  # as written: "-1e9", "1e5", "float('-1e9')"


def find_constants(line: str, fmt: NumberFormat) -> list[RangeConstant]:
    """Numeric literals in ``line`` whose magnitude ``fmt`` cannot hold (finite, above max).

    >>> [c.text for c in find_constants("s = s.masked_fill(m, -1e9)", get_format("float16"))]
    ['-1e9']
    """
    try:
        tree = ast.parse(line.strip(), mode="exec")
    except SyntaxError:
        return []
    found: list[RangeConstant] = []
    seen: set[tuple[int, int]] = set()
    for node in ast.walk(tree):
        value = _literal(node)
        if value is None or not math.isfinite(value) or abs(value) <= fmt.max:
            continue
        key = (node.col_offset, getattr(node, "end_col_offset", 0) or 0)
        inner = node.operand if isinstance(node, ast.UnaryOp) else None
        if inner is not None:
            seen.add((inner.col_offset, getattr(inner, "end_col_offset", 0) or 0))
        if key in seen:
            continue
        seen.add(key)
        text = ast.get_source_segment(line.strip(), node) or repr(value)
        found.append(RangeConstant(value, text))
    return found


def _literal(node: ast.AST) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and \
            not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _literal(node.operand)
        if inner is not None:
            return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id == "float" and len(node.args) == 1 and \
            isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        try:
            return float(node.args[0].value)
        except ValueError:
            return None
    return None


def finfo_fix(line: str, constant: RangeConstant, fmt: NumberFormat) -> str:
    """The user's line with the constant replaced by ``torch.finfo(<dtype>).min`` / ``.max``,
    the dtype taken from the call (``dtype=...``, or the tensor the method is called on).

    >>> finfo_fix("s = s.masked_fill(m, -1e9)", RangeConstant(-1e9, "-1e9"),
    ...           get_format("float16"))
    's = s.masked_fill(m, torch.finfo(s.dtype).min)'
    """
    text = line.strip()
    dtype = dtype_expr(text, constant) or f"torch.{fmt.name}"
    bound = "min" if constant.value < 0 else "max"
    return text.replace(constant.text, f"torch.finfo({dtype}).{bound}", 1)


def dtype_expr(line: str, constant: RangeConstant) -> str | None:
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        args = [ast.get_source_segment(line, a) for a in [*node.args,
                                                          *(k.value for k in node.keywords)]]
        if constant.text not in args:
            continue
        for kw in node.keywords:
            if kw.arg == "dtype":
                return ast.get_source_segment(line, kw.value)
        if isinstance(node.func, ast.Attribute):
            receiver = ast.get_source_segment(line, node.func.value)
            if receiver and receiver not in ("torch", "F", "torch.nn.functional"):
                return f"{receiver}.dtype"
    return None


@rule(id="range-constant", kind="overflow")
def range_constant(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """The script crashed filling a low-precision tensor with a constant beyond its range, or
    the replay's first non-finite value is such a constant, converted silently to inf."""
    crash = trace.crash
    m = _RANGE_ERROR.search(crash.message) if crash is not None else None
    if crash is None or m is None:
        if crash is None:
            yield from _replayed_constant(ctx)
        return
    name = _C10_TYPES.get(m.group(1), m.group(1))
    try:
        fmt = get_format(name)
    except NanhuntError:
        fmt = ctx.fmt
    constants = find_constants(crash.source_line or "", fmt)
    where = f" in {crash.module}" if crash.module else ""
    named = {k: v for k, v in crash.values.items() if math.isfinite(v) and abs(v) > fmt.max}
    if constants:
        c = constants[0]
        what = f"the constant {c.text}"
        data_constant: float | None = c.value
    elif named:
        key, data_constant = next(iter(named.items()))
        what = f"the constant {key} = {data_constant:g}"
        constants = [RangeConstant(data_constant, key)]
    else:
        what, data_constant = f"a constant beyond {fmt.name}'s range", None
    evidence = [
        f"the script raised {crash.type}: {crash.message}",
        f"{fmt.name} holds magnitudes up to {fmt.max:g} (torch.finfo(torch.{fmt.name}).max)",
    ]
    if crash.source:
        evidence.insert(1, f"at {crash.source}{where}: {crash.source_line or ''}".rstrip(": "))
    if constants:
        evidence.append(f"{constants[0].text} is {abs(constants[0].value):g} in magnitude, "
                        f"{math.log2(abs(constants[0].value) / fmt.max):.1f} binades beyond it")
    yield _finding(
        "error",
        f"{what}{_at(crash)}{where} does not fit {fmt.name} (max {fmt.max:g}): torch refuses "
        f"to write it into a {fmt.name} tensor; use torch.finfo(dtype).min / .max, which "
        "fit every format",
        evidence,
        phase="forward" if crash.module else "data",
        step=crash.step,
        module=crash.module,
        data={"constant": data_constant, "text": constants[0].text if constants else None,
              "dtype": fmt.name, "source": crash.source, "source_line": crash.source_line},
    )


#: ops that write a Python number into a tensor (torch.where's scalar operand, a fill, a full)
_FILLS = frozenset({"scalar_tensor", "full", "full_like", "new_full", "fill", "fill_",
                    "masked_fill", "masked_fill_", "where", "clamp", "clamp_min", "clamp_max"})


def _replayed_constant(ctx: Context) -> Iterator[Finding]:
    """``torch.where(mask, x, -1e5)`` or ``torch.full(..., 1e5)`` on a float16 tensor does not
    raise: the number becomes +-inf without a word. The replay's first non-finite op wrote it."""
    f = ctx.failure
    if f is None or f.phase != "forward":
        return
    op = next((o for o in ctx.trace.ops if o.first_nonfinite), None)
    if op is None or op_name(op.op) not in _FILLS:
        return
    fmt = ctx.format_of(op.dtype)
    big = [v for v in op.scalars if math.isfinite(v) and abs(v) > fmt.max]
    if not big:
        return
    source, _, line = (op.source or "").partition("  ")
    constants = find_constants(line, fmt) or [RangeConstant(big[0], f"{big[0]:g}")]
    c = constants[0]
    at = f" ({line.strip()} at {short_source(source)})" if line else ""
    where = f" in {f.module}" if f.module else ""
    yield _finding(
        "error",
        f"the constant {c.text}{at}{where} does not fit {fmt.name} (max {fmt.max:g}): torch "
        f"turned it into {'-' if c.value < 0 else '+'}inf without an error (aten.{op_name(op.op)}"
        "), and what follows of it is non-finite; use torch.finfo(dtype).min / .max, which fit "
        "every format",
        [f"the replay of {f.module or 'the top level'} names aten.{op_name(op.op)} called with "
         f"{c.value:g} as the first op whose output is non-finite: "
         f"{short_source(source) if source else ''} {line.strip()}".rstrip(),
         f"{fmt.name} holds magnitudes up to {fmt.max:g} (torch.finfo(torch.{fmt.name}).max); "
         f"{abs(c.value):g} is {math.log2(abs(c.value) / fmt.max):.1f} binades beyond it"],
        phase="forward",
        step=f.step,
        module=f.module or None,
        data={"constant": c.value, "text": c.text, "dtype": fmt.name, "source": source or None,
              "source_line": line.strip() or None},
    )


# ----------------------------------------------------------------------------- an eps that is 0

#: ops that divide by, or take the root of, what an eps was added to


@rule(id="norm-eps", kind="underflow", needs=("first_failure",))
def norm_eps(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """An eps added in a low-precision format rounds to 0, and the division or root it was
    meant to protect makes inf/NaN (a hand-written norm's ``var + 1e-12`` in float16)."""
    f = ctx.failure
    if f is None or f.phase not in ("forward", "backward"):
        return
    v = vanished_eps(trace.ops, f.phase)
    if v is None:
        return
    layer = ctx.layer(f.module)
    norm = layer is not None and is_norm_type(layer.type)
    src = v.add.source or ""
    consumer = op_name(v.consumer.op)
    evidence = [
        f"replaying {f.module}: aten.{op_name(v.add.op)} added {v.eps:g} to a {v.fmt.name} "
        f"tensor{' at ' + src if src else ''}",
        f"{v.eps:g} becomes 0 in {v.fmt.name}: its smallest subnormal is "
        f"{v.fmt.smallest_subnormal:.3g} (torch.tensor({v.eps:g}, dtype=torch.{v.fmt.name}) == 0)",
    ]
    if v.add.zeros:
        evidence.append(
            f"the sum held {v.add.zeros} exact zeros of {v.add.numel} values (rows with zero "
            "variance or mean square: padding, blank inputs, dead units)")
    evidence.append(
        f"then aten.{consumer} made {v.consumer.nonfinite} non-finite values of "
        f"{v.consumer.numel}" + (f" at {v.consumer.source}" if v.consumer.source else ""))
    c = _forward_class(ctx) if f.phase == "forward" else None
    if c is not None:
        evidence.append(c.evidence[0])
    what = f"{f.module}'s eps" if norm else f"the eps added in {f.module}"
    yield _finding(
        "error",
        f"{what} ({v.eps:g}) is 0 in {v.fmt.name}, so aten.{consumer} divides by zero at step "
        f"{f.step}: an eps must be a nonzero {v.fmt.name} number (1e-5 or more), or the "
        "normalisation must compute in float32",
        evidence,
        phase=f.phase,
        step=f.step,
        module=f.module or None,
        tensor=f.tensor,
        data={"eps": v.eps, "becomes": rounded(v.eps, v.fmt), "dtype": v.fmt.name,
              "op": consumer, "source": src},
    )


# ----------------------------------------------------------------------------- unnormalised input


def _parametrised(layer_name: str, ctx: Context) -> bool:
    layer = ctx.layer(layer_name)
    return layer is not None and (layer.params > 0 or bool(layer.param_amax_by_step)
                                  or layer.param_grad is not None)


def _first_layer(ctx: Context, f: Failure) -> bool:
    """No module with parameters ran before the culprit (its ancestors are containers)."""
    if not _parametrised(f.module, ctx):
        return False
    for layer in ctx.trace.layers:
        if layer.module == f.module:
            return True
        if ctx.is_descendant(f.module, layer.module) or not layer.module:
            continue
        if _parametrised(layer.module, ctx):
            return False
    return False


def _largest_input(f: Failure) -> InputRange | None:
    ranges = [r for r in f.inputs if r.amax > 0]
    return max(ranges, key=lambda r: r.amax) if ranges else None


@rule(id="input-range", kind="bad_input", needs=("first_failure", "layers"))
def input_range(trace: Trace, ctx: Context) -> Iterator[Finding]:
    """The batch is far outside a normalised range (raw pixel counts, features in the
    thousands) and the first layer that takes it overflows."""
    f = ctx.failure
    if f is None or f.phase != "forward" or not _first_layer(ctx, f):
        return
    c = _forward_class(ctx)
    big = _largest_input(f)
    if big is None or big.amax < ctx.th.raw_input:
        return
    # an input beyond the format's max becomes inf in the cast, whatever the op does with it
    # next (inf - inf in a conv is NaN: not an invalid op of the model's)
    if c.name != "overflow" and not big.amax > c.fmt.max:
        return
    if "weights" in c.data.get("large", ()):
        return  # its weights are large too: the weights' growth is the cause to look at
    fmt = c.fmt
    evidence = [
        f"step {f.step}: {f.module}'s {big.path} ({big.dtype}, shape "
        f"{'x'.join(map(str, big.shape))}) ranged from {big.min:.4g} to {big.max:.4g} (mean "
        f"{big.mean:.4g}, std {big.std:.4g}): raw values, while a normalised input stays "
        "within a few units of 0",
        c.evidence[0],
    ]
    if big.amax > fmt.max:
        evidence.append(f"the input itself exceeds {fmt.name}'s max ({fmt.max:g}): casting it "
                        f"to {fmt.name} already makes inf")
    else:
        evidence.append(f"{f.module} is the first layer with weights: its sums of inputs as "
                        f"large as {big.amax:.4g} exceed {fmt.name}'s max")
    op = c.data.get("op")
    if op:
        evidence.append(f"the replay names aten.{op} as the op that made it")
    yield _finding(
        "error",
        f"the batch reaching {f.module} is not normalised (values up to {big.amax:.4g}), and "
        f"{f.module}, the first layer, overflows {fmt.name} on it at step {f.step}: normalise "
        "the input first",
        evidence,
        phase="data",
        step=f.step,
        module=f.module,
        tensor=big.path,
        data={"min": big.min, "max": big.max, "mean": big.mean, "std": big.std,
              "amax": big.amax, "path": big.path, "dtype": big.dtype},
    )
