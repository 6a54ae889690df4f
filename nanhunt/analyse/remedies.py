"""From recommendations to installable fixes: the ``--fix`` specs of each recommendation, the
snippet they stand for, and the wider fixes to try when the narrowest one fails. Torch-free.

:func:`attach_fixes` gives every recommendation its ``fix`` specs (none for a change only the
code can make: a log_softmax, a cleaned batch, the loop's GradScaler calls) and, where a spec
installs it, the snippet generated from that spec, so the printed code and the installed fix
are one change. :func:`ladder` lists what re-run verification tries, narrowest first: the
culprit instance, its sibling instances, the enclosing block, the enclosing stage, the whole
model; an eps or floor from the target's smallest normal up by factors of ten.
"""

from __future__ import annotations

import math
import re

from nanhunt.analyse.diagnose import is_loss_type, module_pattern
from nanhunt.fixspec import MAX_SAMPLES, FixSpec, SnippetContext, number, parse_fix, snippet
from nanhunt.formats import get_format
from nanhunt.trace import Recommendation, Trace

__all__ = ["attach_fixes", "cure_rank", "ladder", "verify_order"]

#: fixes that act through a torch optimizer
_OPTIMIZER_KINDS = ("opt-eps", "lr-factor", "clip", "fp32-master", "warmup")
#: types a fix spec installs; the others need a code change
_INSTALLABLE = ("fp32_module", "clamp", "eps", "init_scale", "clip_grad_norm", "lower_lr",
                "fp32_master_weights", "fp32_lines", "z_loss", "logit_cap", "lr_warmup",
                "comm_hook", "no_comm_hook", "fix_data")
#: which recommendation types re-run verification tries first (most likely to cure first):
#: a floor removes the invalid op (an eps too, when the module has one), float32 master
#: weights change only the optimizer's arithmetic (every module still computes in low
#: precision), a float32 region keeps a module's values, a clamp only bounds a symptom
_PRIORITY = {"comm_hook": 0, "no_comm_hook": 1,
             "clamp_op": 0, "eps": 1, "fp32_master_weights": 1, "fp32_lines": 1,
             "fp32_module": 2,
             "init_scale": 3, "logit_cap": 3, "z_loss": 3, "lr_warmup": 4,
             "clip_grad_norm": 4, "lower_lr": 5, "fix_data": 5, "clamp": 6}
_DEFAULT_GROWTH_INTERVAL = 2000


def _device(trace: Trace) -> str:
    m = re.match(r"[a-z]+", trace.run.device or "")
    return m.group(0) if m and m.group(0) in ("cpu", "cuda", "xpu", "mps", "hpu") else "cuda"


def _refs(trace: Trace) -> dict[str, str]:
    """Roots outside the model (a loss module), by the variable the user calls them."""
    return {layer.module: layer.module for layer in trace.layers
            if "." not in layer.module and is_loss_type(layer.type)}


def specs_for(rec: Recommendation, trace: Trace) -> list[FixSpec]:
    """The fix specs that install ``rec``; [] when it needs a change to the code."""
    d = rec.data
    if rec.type == "fp32_module" and d.get("source") == "audit":
        return [parse_fix(f) for f in rec.fix]  # each standout alone, its output cast back
    if rec.type == "fp32_module":
        region = [str(r) for r in d.get("region") or [rec.module]] if rec.module or \
            d.get("region") else []
        if not region:
            return []
        if len(region) == 1:
            text = f"fp32:{region[0]}" if d.get("cast_to") else f"fp32:{region[0]}.."
        else:
            n = min(max(int(d.get("region_ends", 1)), 1), len(region) - 1)
            text = f"fp32:{','.join(region[:-n])}..{','.join(region[-n:])}"
        return [parse_fix(text)]
    if rec.type == "clamp":
        where = d.get("where", "output")
        if where == "output" and rec.module:
            return [parse_fix(f"clamp:{rec.module}={number(float(d.get('bound', rec.value)))}")]
        op = d.get("op") or (_failure_op(trace) if where == "input" else None)
        if where in ("op_input", "input") and rec.module and op:
            return [parse_fix(f"floor:{rec.module}:{op}={number(float(d.get('min', rec.value)))}")]
        return []
    if rec.type == "eps":
        if d.get("where") == "optimizer":
            return [parse_fix(f"opt-eps={number(float(rec.value))}")]
        return [parse_fix(f"eps:{rec.module}={number(float(rec.value))}")] if rec.module else []
    if rec.type == "init_scale" and trace.run.scaler:
        specs = [parse_fix(f"init-scale={number(float(rec.value))}")]
        interval = d.get("growth_interval")
        own = (trace.run.scaler_settings or {}).get("growth_interval", _DEFAULT_GROWTH_INTERVAL)
        if interval and int(interval) != int(own):  # only what differs from the script's
            specs.append(parse_fix(f"growth-interval={int(interval)}"))
        return specs
    if rec.type == "clip_grad_norm":
        return [parse_fix(f"clip={number(float(rec.value))}")]
    if rec.type == "lower_lr":
        return [parse_fix(f"lr-factor={number(float(rec.value))}")]
    if rec.type == "fp32_master_weights":
        return [parse_fix("fp32-master")]
    if rec.type == "fp32_lines":
        return [parse_fix(f) for f in rec.fix]
    if rec.type in ("z_loss", "logit_cap") and rec.module and rec.value:
        kind = "zloss" if rec.type == "z_loss" else "cap"
        return [parse_fix(f"{kind}:{rec.module}={number(float(rec.value))}")]
    if rec.type == "lr_warmup" and rec.value:
        return [parse_fix(f"warmup={int(rec.value)}")]
    if rec.type == "comm_hook":
        return [parse_fix("comm-hook:bf16")]
    if rec.type == "no_comm_hook":
        return [parse_fix("comm-hook:none")]
    if rec.type == "fix_data":
        # some rows of the batch were non-finite: those rows replaced (the experiment), dropped
        # (the snippet); a batch bad in every row has no installable fix (the loop skips it)
        f, v = trace.first_failure, rec.value if isinstance(rec.value, dict) else {}
        rows = sorted({int(i) for idx in (v.get("samples") or {}).values() for i in idx})
        if f is not None and v.get("step") is not None and rows and f.batch_rows and \
                len(rows) < f.batch_rows and len(rows) <= MAX_SAMPLES:
            return [parse_fix(f"skip-samples={int(v['step'])}:{','.join(map(str, rows))}")]
    return []


def _failure_op(trace: Trace) -> str | None:
    f = trace.first_failure
    op = (f.op or "").removeprefix("aten.") if f else ""
    return op if op in ("log", "log2", "log10", "sqrt", "rsqrt", "reciprocal", "div", "pow") \
        else None


def context(trace: Trace, rec: Recommendation | None = None) -> SnippetContext:
    f = trace.first_failure
    fmt = get_format(trace.run.target)
    low = fmt.name if fmt.name in ("float16", "bfloat16") else None
    if rec is not None and rec.type == "fp32_module" and not rec.data.get("cast_to"):
        low = None
    same = f is not None and rec is not None and rec.module == f.module
    return SnippetContext(device=_device(trace), low=low, scaler=trace.run.scaler,
                          refs=_refs(trace), source=f.source if same else None,
                          source_line=f.source_line if same else None,
                          optimizer=_optimizer_name(trace))


def _optimizer_name(trace: Trace) -> str | None:
    """How the script refers to the optimizer it stepped; None when it stepped none."""
    if not trace.optimizers:
        return None
    return trace.optimizers[0].name or "optimizer"


# a name ``optimizer`` in snippet code (not ``self.optimizer``, not ``optimizer_x``)
_OPTIMIZER = re.compile(r"(?<![\w.])optimizer(?!\w)")


def _rename_optimizer(code: str, name: str) -> str:
    """A snippet written for a variable ``optimizer``, with the script's own name in its code
    (comments unchanged)."""
    out = []
    for line in code.splitlines():
        body, hash_, comment = line.partition("#")
        out.append(_OPTIMIZER.sub(name, body) + hash_ + comment)
    return "\n".join(out)


#: recommendation type -> the spec kinds whose value is the recommendation's value
_VALUE_OF = {"init_scale": ("init-scale",), "clip_grad_norm": ("clip",),
             "lower_lr": ("lr-factor",), "eps": ("eps", "opt-eps"), "clamp": ("clamp", "floor"),
             "z_loss": ("zloss",), "logit_cap": ("cap",), "lr_warmup": ("warmup",)}


_COUNTS = ("warmup", "growth-interval", "skip-batch")


def _take_values(rec: Recommendation, specs: list[FixSpec]) -> None:
    """The recommendation's value and data are what ``specs`` install: after re-run
    verification settles on a wider rung (init_scale 2^21 where 2^25 failed), the card heads
    with the value that was verified, not the one first computed."""
    for spec in specs:
        if spec.kind in _VALUE_OF.get(rec.type, ()) and spec.value is not None:
            # a count (warm-up steps) stays a whole number, as its spec prints it
            rec.value = int(spec.value) if spec.kind in _COUNTS and \
                float(spec.value).is_integer() else spec.value
            if spec.kind == "init-scale":
                k = math.log2(spec.value) if spec.value > 0 else None
                if k is not None and k.is_integer():
                    rec.data["k"] = int(k)
            elif spec.kind == "clamp":
                rec.data["bound"] = spec.value
            elif spec.kind == "floor":
                rec.data["min"] = spec.value
        elif spec.kind == "growth-interval" and rec.type == "init_scale" and spec.value:
            rec.data["growth_interval"] = int(spec.value)
        elif spec.kind == "fp32" and rec.type == "fp32_module" and spec.patterns:
            region = list(spec.patterns)
            if region != (rec.data.get("region") or [rec.module]):
                rec.value = region if len(region) > 1 else region[0]


def set_fix(rec: Recommendation, trace: Trace, specs: list[FixSpec]) -> None:
    """Make ``specs`` the recommendation's fix, with the snippet generated from them; its
    value becomes theirs."""
    _take_values(rec, specs)
    rec.fix = [str(s) for s in specs]
    snip = snippet(specs, context(trace, rec))
    rec.snippet, rec.helper = snip.code, snip.helper
    rec.code_change = False


def attach_fixes(trace: Trace) -> None:
    """Give each recommendation its --fix specs and the snippet those specs stand for. A script
    with no torch optimizer gets no optimizer fix (--fix would refuse it): its snippet changes
    the script's own update; the other snippets use the script's name for its optimizer."""
    name = _optimizer_name(trace)
    for rec in trace.recommendations:
        specs = specs_for(rec, trace) if rec.type in _INSTALLABLE else []
        if name is None and any(s.kind in _OPTIMIZER_KINDS for s in specs):
            own = [s for s in specs if s.kind in ("clip", "lr-factor", "warmup")]
            if own:
                snip = snippet(own, context(trace, rec))
                rec.snippet, rec.helper = snip.code, snip.helper
            specs = []
        if specs:
            set_fix(rec, trace, specs)
        else:
            rec.fix, rec.code_change = [], True
            if name not in (None, "optimizer") and rec.snippet:
                rec.snippet = _rename_optimizer(rec.snippet, name)


def cure_rank(rec: Recommendation) -> int:
    """How likely a recommendation's kind is to cure rather than bound the symptom (lower
    first): a floor or an eps removes the invalid op, float32 keeps the values, a clamp last."""
    kind = "clamp_op" if rec.type == "clamp" and rec.data.get("where") != "output" \
        else rec.type
    return _PRIORITY.get(kind, 9)


def verify_order(recs: list[Recommendation]) -> list[Recommendation]:
    """Installable recommendations, the most likely to cure first (stable otherwise)."""
    return sorted((r for r in recs if r.fix), key=cure_rank)


# ----------------------------------------------------------------------------- the ladder


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _blocks_of(name: str) -> list[str]:
    """The enclosing numbered containers, nearest first: ``encoder.block.1.layer.0`` and
    ``encoder.block.1`` of ``encoder.block.1.layer.0.wo``."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts) - 2, -1, -1) if parts[i].isdigit()]


def _fp32_rungs(rec: Recommendation, trace: Trace) -> list[str]:
    spec = parse_fix(rec.fix[0])
    starts, ends = list(spec.starts), list(spec.patterns[len(spec.starts):])
    first = (starts or ends)[0]
    end = ends[-1] if starts and ends else None
    rungs = [rec.fix[0]]

    def region(start: list[str], stop: str | None) -> str:
        if stop is None or any(stop == s or stop.startswith(s.rstrip("*") + ".") for s in start):
            return "fp32:" + ",".join(start)
        return "fp32:" + ",".join(start) + ".." + stop

    sib = [module_pattern(s) for s in (starts or ends)]
    sib_end = module_pattern(end) if end else None
    rungs.append(region(list(dict.fromkeys(sib)), sib_end))
    for block in _blocks_of(first):
        rungs.append(region([module_pattern(block)], sib_end))
    stage = first.split(".")[0]
    if stage and stage != first:
        rungs.append(region([stage], sib_end))
    model = _model_name(trace)
    if model:
        rungs.append(f"fp32:{model}")
    return rungs


def _model_name(trace: Trace) -> str | None:
    """The model's own name in the report: the root is named by its variable, its submodules
    without it (``model``, beside ``encoder.blocks.0``)."""
    names = [layer.module for layer in trace.layers]
    for layer in reversed(trace.layers):  # the root's call ends last
        name = layer.module
        if name and "." not in name and not is_loss_type(layer.type) and \
                not any(n.startswith(name + ".") for n in names) and \
                any("." in n for n in names):
            return name
    return None


def _contains_more(text: str, culprit: FixSpec) -> bool:
    """Whether an fp32 rung runs more than the culprit (and its siblings) in float32."""
    spec = parse_fix(text)
    own = {module_pattern(p) for p in culprit.patterns} | set(culprit.patterns)
    return not set(spec.patterns) <= own


def ladder(rec: Recommendation, trace: Trace) -> list[list[str]]:
    """The fixes re-run verification tries for ``rec``, narrowest first (duplicates dropped)."""
    if not rec.fix:
        return []
    first = parse_fix(rec.fix[0])
    rungs: list[list[str]] = [list(rec.fix)]
    if first.kind == "fp32":
        rungs += [[r] for r in _fp32_rungs(rec, trace)]
        if rec.data.get("fp32_exceeds"):
            # the replay showed its float32 output above the max: casting it back right after
            # it (alone or with its siblings) gives inf again, so start where a region does
            rungs = [r for r in rungs if ".." in r[0] or _contains_more(r[0], first)]
    elif first.kind == "clamp":
        block = (_blocks_of(first.patterns[0]) or [_parent(first.patterns[0])])[0]
        if block:
            rungs.append([f"clamp:{module_pattern(block)}={number(first.value)}"])
    elif first.kind in ("floor", "eps", "opt-eps"):
        for factor in (10.0, 100.0):
            value = float(f"{(first.value or 0.0) * factor:.3g}")
            if first.kind == "floor":
                rungs.append([f"floor:{first.patterns[0]}:{first.op}={number(value)}"])
            elif first.kind == "eps":
                rungs.append([f"eps:{first.patterns[0]}={number(value)}"])
            else:
                rungs.append([f"opt-eps={number(value)}"])
    elif first.kind == "init-scale":
        rungs.append([f"init-scale={number((first.value or 1.0) / 16)}", *rec.fix[1:]])
    elif first.kind == "clip":
        rungs.append([f"clip={number((first.value or 1.0) / 10)}"])
    elif first.kind == "lr-factor":
        rungs.append([f"lr-factor={number((first.value or 1.0) / 10)}"])
    elif first.kind == "zloss":
        rungs.append([f"zloss:{first.patterns[0]}={number((first.value or 1e-4) * 10)}"])
    elif first.kind == "cap":
        # a capped attention passes the growth to its siblings (the same layer in the other
        # blocks): cap them all, then lower
        sib = module_pattern(first.patterns[0])
        rungs.append([f"cap:{sib}={number(first.value)}"])
        rungs.append([f"cap:{sib}={number((first.value or 20.0) / 2)}"])
    seen: list[list[str]] = []
    for r in rungs:
        canon = [str(parse_fix(s)) for s in r]
        if canon not in seen:
            seen.append(canon)
    return seen
