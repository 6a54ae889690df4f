"""Fixes as data: the ``--fix`` spec language and the snippet each spec stands for. Torch-free.

A spec names one change a user could make to their training script::

    fp32:PATTERN[,PATTERN...]   run these modules in float32 (autocast off, inputs cast up),
                                each output cast back to the half-precision dtype
    fp32:START[,...]..END[,...] a float32 region: START's modules keep a float32 output, which
                                runs on (by type promotion) to END's modules, cast back there;
                                ``fp32:START..`` keeps the output float32 (no cast back)
    clamp:PATTERN=VALUE         clamp these modules' outputs to [-VALUE, VALUE]
    floor:PATTERN:OP=VALUE      inside these modules, floor OP's input at VALUE
                                (OP: log, log2, log10, sqrt, rsqrt, reciprocal, div, pow)
    eps:PATTERN=VALUE           set these normalisation modules' eps (eps, variance_epsilon,
                                epsilon attributes)
    zloss:PATTERN=COEF          add COEF x mean(logsumexp(output)^2) of these modules' outputs
                                (the logits) to the script's loss, at its cross_entropy/nll_loss
    cap:PATTERN=VALUE           inside these modules, soft-cap every softmax's input:
                                VALUE x tanh(x / VALUE) (masked -inf entries stay masked)
    opt-eps=VALUE               every optimizer's eps
    init-scale=VALUE            GradScaler's init_scale
    growth-interval=N           GradScaler's growth_interval
    clip=MAX_NORM               clip_grad_norm_ after unscale_, before each optimizer step
    lr-factor=F                 multiply every optimizer's learning rate by F
    warmup=N                    linear warm-up: the k-th optimizer step (from 0) uses
                                min(1, (k+1)/N) x the lr the script set for it (composes
                                with the script's own schedule)
    fp32-master                 float32 master weights for a half-precision model
    fp32-all                    float32 everywhere: autocast off, the script's .half() and
                                .to(float16|bfloat16) no-ops, GradScaler disabled
    bf16                        bfloat16 where the script uses float16 (autocast, casts)
    no-scaler                   GradScaler disabled (enabled=False)
    skip-batch=N                at step N, the model and loss modules get step N-1's inputs
    skip-samples=N:I[,J...]     at step N, rows I, J, ... of the model and loss modules'
                                batch inputs are replaced by the batch's first other row
                                (the batch keeps its size; the snippet drops the rows)
    fp32-lines:FILE:A[-B]       the torch ops written on lines A..B of FILE (a path, or its
                                end: ``train.py``) in float32 (autocast off, 16-bit inputs cast
                                up), also inside functions those lines call, not inside the
                                modules they call (those keep their precision)
    comm-hook:bf16              DDP's gradient all-reduce in bfloat16 where the script
                                registers fp16_compress_hook (bf16_compress_hook instead)
    comm-hook:none              no DDP communication hook: the script's register_comm_hook
                                is skipped, DDP all-reduces in the gradients' own dtype

PATTERN is a glob over qualified module names (``fnmatch``: ``*`` also spans dots). The snippet
(:func:`snippet`) is the same change written as code the user pastes; nanhunt.experiment.fixes
installs the
spec from outside the script, and tests check that both give the same losses.

>>> str(parse_fix("fp32:encoder.blocks.*.ffn.wo..norm"))
'fp32:encoder.blocks.*.ffn.wo..norm'
>>> parse_fix("floor:norm:sqrt=6.1e-5").value
6.1e-05
"""

from __future__ import annotations

import ast
import json
import linecache
import math
import re
from dataclasses import dataclass, field

from nanhunt.errors import NanhuntError

__all__ = [
    "FLOOR_OPS",
    "MODULE_KINDS",
    "FixSpec",
    "Snippet",
    "SnippetContext",
    "parse_fix",
    "sample_rows",
    "snippet",
]

#: ops whose input a floor keeps at or above a value (div: the denominator)
FLOOR_OPS = ("log", "log2", "log10", "sqrt", "rsqrt", "reciprocal", "div", "pow")
#: kinds that name modules by a pattern
MODULE_KINDS = ("fp32", "clamp", "floor", "eps", "zloss", "cap")
_VALUE_KINDS = ("opt-eps", "init-scale", "growth-interval", "clip", "lr-factor", "warmup",
                "skip-batch")
#: kinds with no value or pattern
BARE_KINDS = ("fp32-master", "fp32-all", "bf16", "no-scaler")
#: comm-hook:CHOICE, what DDP's gradient all-reduce becomes
COMM_HOOK_CHOICES = ("bf16", "none")
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")


@dataclass(frozen=True)
class FixSpec:
    """One parsed ``--fix``; ``str(spec)`` gives it back in canonical form."""

    kind: str
    patterns: tuple[str, ...] = ()  # fp32: the region's START patterns, then its END patterns
    value: float | None = None
    op: str | None = None
    ends: int = 0  # fp32: how many of ``patterns`` (the last ones) are END patterns

    @property
    def starts(self) -> tuple[str, ...]:
        return self.patterns[: len(self.patterns) - self.ends]

    def __str__(self) -> str:
        if self.kind == "fp32":
            ends = ",".join(self.patterns[len(self.starts):])
            return "fp32:" + (",".join(self.starts) + ".." if self.starts else "") + ends
        if self.kind in ("clamp", "eps", "zloss", "cap"):
            return f"{self.kind}:{self.patterns[0]}={number(self.value)}"
        if self.kind == "floor":
            return f"floor:{self.patterns[0]}:{self.op}={number(self.value)}"
        if self.kind in BARE_KINDS:
            return self.kind
        if self.kind == "comm-hook":
            return f"comm-hook:{self.op}"
        if self.kind == "fp32-lines":
            return f"fp32-lines:{self.patterns[0]}:{self.op}"
        if self.kind == "skip-samples":
            return f"skip-samples={number(self.value)}:{self.op}"
        return f"{self.kind}={number(self.value)}"


def number(value: float | None) -> str:
    """A value as short as it reads back exactly: ``65536``, ``6.103515625e-05``, ``0.1``."""
    if value is None:
        return ""
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _value(text: str, spec: str, *, positive: bool = True) -> float:
    try:
        v = float(text)
    except ValueError:
        raise NanhuntError(f"--fix {spec}: {text!r} is not a number") from None
    if not math.isfinite(v) or (positive and v <= 0):
        raise NanhuntError(f"--fix {spec}: the value must be a positive finite number")
    return v


def parse_fix(text: str) -> FixSpec:
    """Parse one ``--fix`` spec; a malformed one raises :class:`NanhuntError` (exit 2)."""
    spec = text.strip()
    if spec in BARE_KINDS:
        return FixSpec(spec)
    kind, sep, rest = spec.partition(":")
    if kind == "fp32-lines":
        path, colon, lines = rest.rpartition(":")
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", lines.strip())
        if not colon or not path.strip() or m is None:
            raise NanhuntError(f"--fix {spec}: expected fp32-lines:FILE:LINE or "
                               "fp32-lines:FILE:FIRST-LAST")
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
        if first < 1 or last < first:
            raise NanhuntError(f"--fix {spec}: lines run from 1, FIRST <= LAST")
        return FixSpec("fp32-lines", (path.strip(),),
                       op=f"{first}-{last}" if last != first else str(first))
    if spec.startswith("skip-samples="):
        return _skip_samples(spec)
    if kind == "comm-hook":
        if rest not in COMM_HOOK_CHOICES:
            raise NanhuntError(f"--fix {spec}: expected comm-hook:bf16 or comm-hook:none")
        return FixSpec("comm-hook", op=rest)
    if sep and kind in MODULE_KINDS:
        if kind == "fp32":
            start, dots, end = rest.rpartition("..")
            starts = tuple(p.strip() for p in start.split(",")) if dots else ()
            ends = tuple(p.strip() for p in end.split(",")) if end or not dots else ()
            if not all(starts + ends) or not (starts + ends):
                raise NanhuntError(f"--fix {spec}: give module name patterns (fp32:PATTERN, "
                                   "fp32:START..END)")
            return FixSpec("fp32", starts + ends, ends=len(ends))
        target, eq, value = rest.rpartition("=")
        if not eq or not target:
            raise NanhuntError(f"--fix {spec}: expected {kind}:PATTERN"
                               + (":OP" if kind == "floor" else "") + "=VALUE")
        if kind == "floor":
            pattern, colon, op = target.rpartition(":")
            if not colon or not pattern:
                raise NanhuntError(f"--fix {spec}: expected floor:PATTERN:OP=VALUE")
            if op not in FLOOR_OPS:
                raise NanhuntError(f"--fix {spec}: unknown op {op!r} (choose from "
                                   f"{', '.join(FLOOR_OPS)})")
            return FixSpec("floor", (pattern,), _value(value, spec), op)
        return FixSpec(kind, (target,), _value(value, spec))
    name, eq, value = spec.partition("=")
    if eq and name in _VALUE_KINDS:
        v = _value(value, spec)
        if name in ("growth-interval", "skip-batch", "warmup") and not v.is_integer():
            raise NanhuntError(f"--fix {spec}: {name} is a whole number of steps")
        return FixSpec(name, (), v)
    raise NanhuntError(
        f"--fix {spec}: unknown fix (fp32:PATTERN, clamp:PATTERN=V, floor:PATTERN:OP=V, "
        "eps:PATTERN=V, zloss:PATTERN=C, cap:PATTERN=V, opt-eps=V, init-scale=V, "
        "growth-interval=N, clip=V, lr-factor=F, warmup=N, fp32-master, fp32-all, bf16, "
        "no-scaler, skip-batch=N, skip-samples=N:I,J, comm-hook:bf16|none, "
        "fp32-lines:FILE:A-B)")


#: at most this many rows in one skip-samples spec (the report lists at most 100 per input)
MAX_SAMPLES = 100


def _skip_samples(spec: str) -> FixSpec:
    """``skip-samples=N:I[,J...]``: the step, then the batch rows, ascending and distinct."""
    m = re.fullmatch(r"skip-samples=(\d+):(\d+(?:,\d+)*)", spec.replace(" ", ""))
    if m is None:
        raise NanhuntError(f"--fix {spec}: expected skip-samples=STEP:ROW[,ROW...] (whole "
                           "numbers: the step, then the batch positions)")
    rows = sorted({int(r) for r in m.group(2).split(",")})
    if len(rows) > MAX_SAMPLES:
        raise NanhuntError(f"--fix {spec}: at most {MAX_SAMPLES} rows")
    return FixSpec("skip-samples", (), float(m.group(1)), ",".join(map(str, rows)))


def sample_rows(spec: FixSpec) -> list[int]:
    """The batch rows of a ``skip-samples`` spec."""
    return [int(r) for r in (spec.op or "").split(",") if r]


# ----------------------------------------------------------------------------- snippets


@dataclass
class SnippetContext:
    """What a snippet needs to know about the user's script.

    ``device``: the autocast device type; ``low``: the half-precision dtype outputs are cast
    back to (``torch.float16``) or None when the module did not run in one; ``scaler``: the
    loop uses a GradScaler; ``refs`` maps a root that is not the model (``criterion``) to the
    variable the user calls it by; ``source``/``source_line``: where the op to floor is called.
    """

    device: str = "cuda"
    low: str | None = "float16"
    scaler: bool = False
    refs: dict[str, str] = field(default_factory=dict)
    source: str | None = None
    source_line: str | None = None
    #: how the script refers to its optimizer (``opt``, ``self.optimizer``); None when it has
    #: none (a hand-written update): the optimizer snippets then change the script's own update
    optimizer: str | None = "optimizer"


@dataclass
class Snippet:
    code: str  # what the user pastes at the call site
    helper: str = ""  # a function the code calls, shown once however many snippets use it


def _q(s: str) -> str:
    return json.dumps(s)


def _root(pattern: str, ctx: SnippetContext) -> tuple[str, str]:
    """The variable holding the modules a pattern names and the pattern inside it."""
    head, _, tail = pattern.partition(".")
    if head in ctx.refs:
        return ctx.refs[head], tail
    return "model", pattern


NONFINITE_ROWS_HELPER = '''\
import torch


def nonfinite_rows(batch):
    """The rows (samples) of a batch holding NaN or Inf."""
    bad = ~torch.isfinite(batch.reshape(batch.shape[0], -1)).all(dim=1)
    return bad.nonzero().flatten().tolist()
'''


FP32_HELPER = '''\
import fnmatch

import torch


def _cast(x, dtype):
    floating = torch.is_tensor(x) and x.is_floating_point()
    return x.to(dtype) if floating else x


def run_in_float32(model, pattern, cast_back=None, device="{device}"):
    """Run submodules named like `pattern` (not those inside one) in float32,
    autocast off; cast a tensor output to `cast_back` (None: float32)."""
    names = [n for n, _ in model.named_modules()
             if fnmatch.fnmatchcase(n, pattern)]
    for name in names:
        if any(name.startswith(outer + ".") for outer in names):
            continue  # already inside a float32 module
        module = model.get_submodule(name).float()

        def forward(*args, _forward=module.forward, **kwargs):
            args = [_cast(a, torch.float32) for a in args]
            kwargs = {{k: _cast(v, torch.float32) for k, v in kwargs.items()}}
            with torch.autocast(device, enabled=False):
                out = _forward(*args, **kwargs)
            if cast_back is None:
                return out
            if type(out) is tuple:
                return tuple(_cast(o, cast_back) for o in out)
            return _cast(out, cast_back)

        module.forward = forward
'''

FP32_MASTER_HELPER = '''\
import torch


def step_with_fp32_master(optimizer, masters):
    """optimizer.step() on float32 copies of half-precision weights
    (`masters` keeps the copies between steps)."""
    swapped = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None or p.dtype == torch.float32:
                continue
            master = masters.setdefault(p, p.detach().float())
            half, grad = p.data, p.grad
            p.grad = None
            p.data = master
            p.grad = grad.float()
            swapped.append((p, half, grad))
    optimizer.step()
    for p, half, grad in swapped:
        half.copy_(p.data)
        p.grad = None
        p.data = half
        p.grad = grad
'''


WARMUP_HELPER = '''\
def add_lr_warmup(optimizer, steps):
    """Linear warm-up on top of any schedule: the k-th optimizer step (from 0)
    uses min(1, (k + 1) / steps) x the lr the script set for it."""
    done, saved = [0], []

    def before(opt, args, kwargs):
        saved[:] = [group["lr"] for group in opt.param_groups]
        for group in opt.param_groups:
            group["lr"] = group["lr"] * min(1.0, (done[0] + 1) / steps)

    def after(opt, args, kwargs):
        for group, lr in zip(opt.param_groups, saved):
            group["lr"] = lr  # the script's own value back
        done[0] += 1

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
'''


FP32_LINES_HELPER = '''\
import sys

import torch
from torch.overrides import TorchFunctionMode

_HALF = (torch.float16, torch.bfloat16)
_MODULE_CALL = ("_call_impl", "_wrapped_call_impl")


def _up(x):
    if torch.is_tensor(x) and x.dtype in _HALF:
        return x.float()
    if isinstance(x, (list, tuple)):
        return type(x)(_up(v) for v in x)
    return x


class Float32Lines(TorchFunctionMode):
    """Torch ops written on lines `first`..`last` of `file` run in float32:
    autocast off, 16-bit inputs cast up (also in functions those lines call,
    not inside the modules they call)."""

    def __init__(self, file, first, last):
        super().__init__()
        self.file, self.first, self.last = file, first, last

    def _on_the_lines(self):
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if code.co_filename.endswith(self.file):
                return self.first <= frame.f_lineno <= self.last
            if code.co_name in _MODULE_CALL:
                return False  # inside a module those lines call
            frame = frame.f_back
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._on_the_lines():
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        in_place = (name.endswith("_") and not name.endswith("__")) or \\
            name.startswith("__i") or name == "__setitem__"
        device = next((a.device.type for a in args if torch.is_tensor(a)), "cpu")
        args = (args[:1] + tuple(_up(a) for a in args[1:])) if in_place \\
            else tuple(_up(a) for a in args)
        kwargs = {k: _up(v) for k, v in kwargs.items()}
        with torch.autocast(device, enabled=False):
            return func(*args, **kwargs)


def keep_lines_in_float32(file, first, last):
    """From now on, the torch ops on those lines run in float32."""
    mode = Float32Lines(file, first, last)
    mode.__enter__()
    return mode
'''


def snippet(specs: list[FixSpec], ctx: SnippetContext) -> Snippet:
    """The code that makes the same change as installing ``specs``."""
    parts: list[Snippet] = [_one(s, ctx) for s in specs]
    code = "\n".join(p.code for p in parts)
    imports = sorted({ln for p in parts for ln in p.code.splitlines()
                      if ln.startswith(("import ", "from "))})
    body = [ln for ln in code.splitlines() if not ln.startswith(("import ", "from "))]
    while body and not body[0].strip():
        body.pop(0)
    code = "\n".join([*imports, "", *body] if imports else body)
    helpers = []
    for p in parts:
        if p.helper and p.helper not in helpers:
            helpers.append(p.helper)
    return Snippet(code, "\n\n".join(helpers))


def _one(spec: FixSpec, ctx: SnippetContext) -> Snippet:
    v = number(spec.value)
    if spec.kind == "fp32-lines":
        first, _, last = (spec.op or "").partition("-")
        return Snippet(f"keep_lines_in_float32({_q(spec.patterns[0])}, {first}, {last or first})"
                       "  # once, before the training loop", FP32_LINES_HELPER)
    if spec.kind == "fp32":
        lines = []
        for i, pattern in enumerate(spec.patterns):
            ref, rel = _root(pattern, ctx)
            last = i >= len(spec.starts)
            if last and ctx.low:
                lines.append(f"run_in_float32({ref}, {_q(rel)}, cast_back=torch.{ctx.low})")
            elif last:
                lines.append(f"run_in_float32({ref}, {_q(rel)})")
            elif spec.ends:
                lines.append(f"run_in_float32({ref}, {_q(rel)})  # float32 onward")
            else:
                lines.append(f"run_in_float32({ref}, {_q(rel)})  # its output stays float32")
        head = ["import torch", ""] if ctx.low else []
        return Snippet("\n".join(head + lines), FP32_HELPER.format(device=ctx.device))
    if spec.kind == "clamp":
        ref, rel = _root(spec.patterns[0], ctx)
        return Snippet("\n".join([
            "import fnmatch",
            "",
            f"for name, module in {ref}.named_modules():",
            f"    if fnmatch.fnmatchcase(name, {_q(rel)}):",
            f"        module.register_forward_hook(lambda m, a, out: out.clamp(-{v}, {v}))",
        ]))
    if spec.kind == "eps":
        ref, rel = _root(spec.patterns[0], ctx)
        return Snippet("\n".join([
            "import fnmatch",
            "",
            f"for name, module in {ref}.named_modules():",
            f"    if fnmatch.fnmatchcase(name, {_q(rel)}):",
            "        for attr in (" + ", ".join(_q(a) for a in _EPS_ATTRS) + "):",
            "            if hasattr(module, attr):",
            f"                setattr(module, attr, {v})",
        ]))
    if spec.kind == "floor":
        return Snippet(_floor_snippet(spec, ctx))
    if spec.kind == "zloss":
        return Snippet("\n".join([
            f"# after the loss; logits: the output of {spec.patterns[0]} in this step's forward",
            f"loss = loss + {v} * logits.float().logsumexp(-1).pow(2).mean()  # z-loss",
        ]))
    if spec.kind == "cap":
        return Snippet("\n".join([
            "import torch",
            "",
            f"# in the forward of {spec.patterns[0]}: the softmax's input (att), before its mask",
            f"att = {v} * torch.tanh(att / {v})  # soft-cap the attention logits at {v}",
        ]))
    opt = ctx.optimizer
    if spec.kind == "warmup" and opt is None:
        return Snippet(f"lr_now = lr * min(1.0, (step + 1) / {v})  # the lr your own update "
                       "uses at each step (step from 0)")
    if spec.kind == "warmup":
        return Snippet(f"add_lr_warmup({opt}, {v})  # once, after the optimizer is made",
                       WARMUP_HELPER)
    if spec.kind == "lr-factor" and opt is None:
        return Snippet(f"lr = lr * {v}  # the learning rate your own weight update uses")
    if spec.kind == "clip" and opt is None:
        return Snippet("import torch\n\n"
                       f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={v})"
                       "  # after backward(), before your weight update")
    if spec.kind == "opt-eps":
        return Snippet(f'for group in {opt}.param_groups:\n    group["eps"] = {v}')
    if spec.kind == "lr-factor":
        return Snippet(f'for group in {opt}.param_groups:\n    group["lr"] *= {v}')
    if spec.kind in ("init-scale", "growth-interval"):
        arg = "init_scale" if spec.kind == "init-scale" else "growth_interval"
        return Snippet(f'scaler = torch.amp.GradScaler("{ctx.device}", {arg}={v})'
                       "  # keep your other arguments")
    if spec.kind == "clip":
        lines = ["import torch", ""]
        if ctx.scaler:
            lines.append(f"scaler.unscale_({opt})  # before scaler.step({opt})")
        lines += [
            f"params = [p for group in {opt}.param_groups for p in group[\"params\"]]",
            f"torch.nn.utils.clip_grad_norm_(params, max_norm={v})"
            + ("" if ctx.scaler else f"  # before {opt}.step()"),
        ]
        return Snippet("\n".join(lines))
    if spec.kind == "fp32-all":
        return Snippet("\n".join([
            "# float32 everywhere: no autocast, no .half() / .to(torch.float16), no loss scaling",
            f'with torch.autocast("{ctx.device}", enabled=False):  # instead of enabled=True',
            "    loss = ...  # the forward and the loss, as before",
            f'scaler = torch.amp.GradScaler("{ctx.device}", enabled=False)']))
    if spec.kind == "bf16":
        return Snippet("\n".join([
            "# bfloat16 where the script used float16 (.half() -> .bfloat16() likewise)",
            f'with torch.autocast("{ctx.device}", dtype=torch.bfloat16):',
            "    loss = ...  # the forward and the loss, as before"]))
    if spec.kind == "no-scaler":
        return Snippet(f'scaler = torch.amp.GradScaler("{ctx.device}", enabled=False)')
    if spec.kind == "comm-hook" and spec.op == "bf16":
        return Snippet("\n".join([
            "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks",
            "",
            "# instead of fp16_compress_hook: bfloat16 has float32's range",
            "model.register_comm_hook(None, default_hooks.bf16_compress_hook)"]))
    if spec.kind == "comm-hook":
        return Snippet("# no model.register_comm_hook(...): DDP then all-reduces the gradients "
                       "in their own dtype")
    if spec.kind == "skip-batch":
        return Snippet("\n".join([
            "for step, batch in enumerate(loader):  # your training loop",
            f"    if step == {v}:  # nanhunt's step {v}: the {_ordinal(int(spec.value or 0))} "
            "training step",
            "        continue  # skip this batch (or clean it)",
            "    ...  # the step, as before",
            "# (the experiment that showed it gave that step the previous batch instead)"]))
    if spec.kind == "skip-samples":
        rows = sample_rows(spec)
        which = (f"row {rows[0]}" if len(rows) == 1 else
                 "rows " + ", ".join(map(str, rows)))
        return Snippet("\n".join([
            f"# step {v}: batch {which} carried NaN/Inf. In the training loop, before the",
            "# model, drop such rows from every tensor of the batch:",
            "bad = nonfinite_rows(inputs)",
            "if bad:",
            "    keep = [i for i in range(len(inputs)) if i not in bad]",
            "    inputs, targets = inputs[keep], targets[keep]  # and masks, ids, ...",
            "# (the experiment that showed it gave those rows another row's values instead)"]),
            NONFINITE_ROWS_HELPER)
    if spec.kind == "fp32-master":
        return Snippet("masters = {}  # once, after the optimizer is made\n"
                       f"step_with_fp32_master({opt}, masters)  # instead of {opt}.step()",
                       FP32_MASTER_HELPER)
    raise NanhuntError(f"no snippet for --fix {spec}")


def _ordinal(k: int) -> str:
    """0 -> "1st", 1 -> "2nd", ...: a step counted from 0, said as a count."""
    n = k + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _floor_snippet(spec: FixSpec, ctx: SnippetContext) -> str:
    """The source line with the op's input floored, or a template of it."""
    op, v = spec.op or "", number(spec.value)
    short = ctx.source.replace("\\", "/").rsplit("/", 1)[-1] if ctx.source else None
    where = f"# {short}: " if short else f"# in {spec.patterns[0]}: "
    line = (ctx.source_line or "").strip()
    edited = _edit_line(line, op, v) if line else None
    if edited is not None and re.match(r"(return|yield)\b", edited):
        head = _enclosing_def(ctx.source)  # `return` needs its function to be valid code
        if head is not None:
            return f"{where}{line}\n{head}\n    ...  # the lines before, unchanged\n    {edited}"
    if edited is not None:
        return f"{where}{line}\n{edited}"
    template = {
        "div": f"y = a / b.clamp_min({v})  # b >= 0",
        "pow": f"y = x.clamp_min({v}) ** p",
    }.get(op, f"y = torch.{op}(x.clamp_min({v}))")
    return where.rstrip() + f" {op}\n{template}"


def _enclosing_def(source: str | None) -> str | None:
    """The ``def`` line of the function around ``path:line``, dedented."""
    if not source or ":" not in source:
        return None
    path, _, num = source.rpartition(":")
    if not num.isdigit():
        return None
    lines = [linecache.getline(path, i) for i in range(int(num), 0, -1)]
    here = lines[0]
    indent = len(here) - len(here.lstrip())
    for text in lines[1:]:
        stripped = text.lstrip()
        if stripped.startswith(("def ", "async def ")) and len(text) - len(stripped) < indent:
            return stripped.rstrip()
    return None


class _Floor(ast.NodeTransformer):
    def __init__(self, op: str, value: str) -> None:
        self.op, self.value, self.hits = op, value, 0

    def _floored(self, node: ast.expr) -> ast.expr:
        self.hits += 1
        return ast.Call(func=ast.Attribute(value=node, attr="clamp_min", ctx=ast.Load()),
                        args=[ast.Constant(float(self.value))], keywords=[])

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == self.op:
            if isinstance(f.value, ast.Name) and f.value.id in ("torch", "F", "math"):
                if node.args:  # torch.sqrt(x) -> torch.sqrt(x.clamp_min(v))
                    i = 1 if self.op == "div" else 0
                    if len(node.args) > i:
                        node.args[i] = self._floored(node.args[i])
            elif self.op != "div" and self.op != "pow":  # x.sqrt() -> x.clamp_min(v).sqrt()
                f.value = self._floored(f.value)
            elif self.op == "div" and node.args:
                node.args[0] = self._floored(node.args[0])
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        if self.op == "div" and isinstance(node.op, ast.Div):
            node.right = self._floored(node.right)
        elif self.op == "pow" and isinstance(node.op, ast.Pow):
            node.left = self._floored(node.left)
        return node


def _edit_line(line: str, op: str, value: str) -> str | None:
    """``line`` with ``op``'s input floored, when it parses and calls ``op`` once."""
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    floor = _Floor(op, value)
    tree = floor.visit(tree)
    if floor.hits != 1:
        return None
    return ast.unparse(tree)
