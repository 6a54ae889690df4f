"""Ranking the audited layers and advising float32 for the ones that stand out (torch-free).

A layer's ``sqnr_db`` is compared with two levels: the SQNR that rounding alone gives in the
format (``nominal_sqnr_db``: 6.02 dB per mantissa bit + 13.8 dB, round-to-nearest error spread
evenly over one unit in the last place, values spread evenly across their binade) and
the median of the audited layers. A layer *stands out* when it is :data:`STANDOUT_DB` below the
lower of the two: its noise power is over 100 times the typical layer's. Containers whose loss
one of their children already shows (within :data:`EXPLAINED_DB`) are not ranked: the child is
the smaller fix.

>>> from nanhunt.trace import PrecisionAudit, PrecisionLayer
>>> from nanhunt.formats import get_format
>>> a = PrecisionAudit("float16", layers=[PrecisionLayer("fc1", "Linear", sqnr_db=66.0),
...     PrecisionLayer("shift", "Shift", sqnr_db=11.0), PrecisionLayer("fc2", "Linear",
...     sqnr_db=64.0)])
>>> rank_layers(a, get_format("float16"))
>>> [(x.module, x.rank, x.stands_out) for x in a.layers]
[('fc1', 3, False), ('shift', 1, True), ('fc2', 2, False)]
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from nanhunt.fixspec import FixSpec, SnippetContext, snippet
from nanhunt.formats import NumberFormat, get_format
from nanhunt.trace import PrecisionAudit, PrecisionLayer, Recommendation

__all__ = [
    "EXPLAINED_DB",
    "JUMP_DB",
    "STANDOUT_DB",
    "VERIFY_FACTOR",
    "drift_added_db",
    "drift_jump_db",
    "fp32_groups",
    "loss_key",
    "nominal_sqnr_db",
    "rank_layers",
    "reasons",
    "recommend",
    "sqnr_db",
]

#: a layer stands out when its SQNR is this far below the typical layer's (100x noise power)
STANDOUT_DB = 20.0
#: a container is explained by a child whose SQNR is within this of its own (or worse): the
#: layers after the child amplify its error, so the container may lose somewhat more
EXPLAINED_DB = 10.0
#: a jump of the end-to-end drift across a layer this large (100x the relative noise power)
#: ranks the layer by the drift it adds (see :func:`loss_key`)
JUMP_DB = 20.0
#: advice counts as checked when the end-to-end loss error at least halves with the fix
VERIFY_FACTOR = 0.5


def sqnr_db(signal: float, noise: float) -> float | None:
    """``10 log10(signal / noise)`` for energies (sums of squares); inf when exact.

    >>> round(sqnr_db(100.0, 1.0), 6), sqnr_db(1.0, 0.0), sqnr_db(0.0, 0.0)
    (20.0, inf, None)
    """
    if noise <= 0:
        return math.inf if signal > 0 else None
    if signal <= 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def drift_jump_db(e2e_in: list[float], e2e_out: list[float]) -> float | None:
    """How far the end-to-end SQNR drops across a layer: that of its inputs minus that of its
    output (energies ``[signal, noise]`` summed over its calls). Positive: the drift against
    float32 grows in the layer; ``inf``: its inputs were exact (the drift starts here); null
    when either side was not measured or both are exact.

    >>> drift_jump_db([1.0, 1e-6], [1.0, 1e-3]), drift_jump_db([1.0, 0.0], [1.0, 1e-2])
    (30.0, inf)
    """
    a, b = sqnr_db(*e2e_in), sqnr_db(*e2e_out)
    if a is None or b is None or (math.isinf(a) and math.isinf(b) and a == b):
        return None
    return a - b


def drift_added_db(e2e_in: list[float], e2e_out: list[float]) -> float | None:
    """The drift a layer adds, as an SQNR comparable with its own: with r = noise / signal
    the relative noise power of its inputs (``r_in``) and of its output (``r_out``) against the
    float32 run, ``-10 log10(r_out - r_in)``; ``inf`` when ``r_out <= r_in`` (it passes the
    drift on without adding to it), null when either side was not measured.

    >>> round(drift_added_db([1.0, 1e-6], [1.0, 1e-3]), 3), drift_added_db([1, 1e-3], [1, 1e-4])
    (30.004, inf)
    """
    (s_in, n_in), (s_out, n_out) = e2e_in, e2e_out
    if s_in <= 0 or s_out <= 0:
        return None
    added = n_out / s_out - n_in / s_in
    return math.inf if added <= 0 else -10.0 * math.log10(added)


def loss_key(layer: PrecisionLayer) -> float:
    """What ranks a layer: its own SQNR, or, where the end-to-end drift jumps across it by
    :data:`JUMP_DB` or more, the lower of that and the SQNR of the drift it adds.

    A smaller jump is left out on purpose: a layer after the culprit that cancels a common
    offset (a Linear over positive sums) raises the drift reaching it a few dB, and ranking it
    by the drift it adds would put it above the layer that made that drift.

    >>> from nanhunt.trace import PrecisionLayer
    >>> loss_key(PrecisionLayer("rho", "Linear", sqnr_db=59.5, drift_jump_db=6.4,
    ...                         drift_added_db=22.2))
    59.5
    >>> loss_key(PrecisionLayer("pool", "Sum", sqnr_db=40.0, drift_jump_db=43.5,
    ...                         drift_added_db=27.6))
    27.6
    """
    own = layer.sqnr_db if layer.sqnr_db is not None else math.inf
    jump, added = layer.drift_jump_db, layer.drift_added_db
    if jump is not None and jump >= JUMP_DB and added is not None:
        return min(own, added)
    return own


def nominal_sqnr_db(fmt: NumberFormat) -> float:
    """SQNR of round-to-nearest alone: the error is uniform over one ulp (variance ulp^2/12)
    and ulp/|x| averages 2^-m / sqrt(2) in mean square over a binade, so 10 log10(24 * 4^m).

    >>> round(nominal_sqnr_db(get_format("float16")), 1)
    74.0
    """
    return 10.0 * math.log10(24.0) + 20.0 * fmt.mantissa_bits * math.log10(2.0)


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _descendants(layers: list[PrecisionLayer]) -> dict[str, list[PrecisionLayer]]:
    children: dict[str, list[PrecisionLayer]] = {}
    for layer in layers:
        if layer.parent is not None:
            children.setdefault(layer.parent, []).append(layer)
    out: dict[str, list[PrecisionLayer]] = {}

    def walk(name: str, seen: set[str]) -> list[PrecisionLayer]:
        if name in out:
            return out[name]
        found: list[PrecisionLayer] = []
        for c in children.get(name, []):
            if c.module not in seen:
                found.append(c)
                found += walk(c.module, seen | {c.module})
        out[name] = found
        return found

    for layer in layers:
        walk(layer.module, {layer.module})
    return out


def rank_layers(audit: PrecisionAudit, fmt: NumberFormat) -> None:
    """Fill ``rank``, ``explained_by``, ``stands_out`` and ``reasons``; set the thresholds."""
    layers = audit.layers
    below = _descendants(layers)
    for layer in layers:
        layer.rank, layer.explained_by, layer.stands_out = None, None, False
        if layer.leaf or layer.sqnr_db is None:
            continue
        worst = min((d for d in below.get(layer.module, []) if d.sqnr_db is not None),
                    key=lambda d: d.sqnr_db, default=None)  # type: ignore[arg-type,return-value]
        if worst is not None and worst.sqnr_db <= layer.sqnr_db + EXPLAINED_DB:
            layer.explained_by = worst.module
    ranked = [x for x in layers if x.explained_by is None and x.sqnr_db is not None]
    ranked.sort(key=lambda x: (loss_key(x), x.sqnr_db, x.order))
    for i, layer in enumerate(ranked, 1):
        layer.rank = i
    nominal = nominal_sqnr_db(fmt)
    finite = [x.sqnr_db for x in ranked if _finite(x.sqnr_db)]
    level = min(statistics.median(finite), nominal) if finite else nominal
    audit.nominal_sqnr_db = nominal
    audit.threshold_db = level - STANDOUT_DB
    for layer in ranked:
        top_container = layer.depth == 0 and not layer.leaf  # "the whole model" is no advice
        layer.stands_out = layer.sqnr_db < audit.threshold_db and not top_container
    for layer in layers:
        layer.reasons = reasons(layer, fmt, nominal) if layer.rank is not None else []


def _bits_text(bits: float) -> str:
    return f"2^{bits:.0f}" if bits >= 10 else f"{2 ** bits:.3g}x"


def reasons(layer: PrecisionLayer, fmt: NumberFormat, nominal: float) -> list[str]:
    """Why a layer loses accuracy, in numbers (the measurements of its float32 replay)."""
    d, out = layer.data, []
    sig = fmt.mantissa_bits + 1  # significant bits, the implicit one included
    if _finite(layer.sqnr_db) and layer.sqnr_db < nominal - 6:  # type: ignore[operator]
        out.append(f"SQNR {layer.sqnr_db:.1f} dB where rounding to {fmt.name} alone gives "
                   f"{nominal:.0f} dB: it loses {nominal - layer.sqnr_db:.0f} dB in its own "
                   "computation")
    c = d.get("cancellation_bits", 0.0)
    if c >= 4:
        left = sig - c
        out.append(f"catastrophic cancellation: operands of an addition reach {_bits_text(c)} "
                   f"times the result's rms, so about {c:.0f} of {fmt.name}'s {sig} significant "
                   "bits cancel" + (f" ({max(left, 0):.0f} left)" if left < sig else "")
                   + ", as in (x + c) - c")
    s = d.get("swamping_bits", 0.0)
    adds = int(d.get("adds", 0))
    if (s >= sig - 2 and c < 4) or (s >= sig - 2 and adds >= 32):
        out.append(f"long accumulation: an addend {_bits_text(s)} times smaller than the sum it "
                   f"is added to, over {adds} additions; {fmt.name} keeps {sig} significant "
                   "bits, so small addends are rounded away")
    k = d.get("reduction_length", 0.0)
    if k >= 2 ** (sig // 2 + 2):
        out.append(f"long reduction: {k:.0f} terms summed into each output")
    p = d.get("periodic_arg_max", 0.0)
    if p > 0:
        ulp = 2.0 ** (math.floor(math.log2(p)) - fmt.mantissa_bits)
        if ulp / 2 > 1e-3:
            out.append(f"sin/cos of arguments up to {p:.4g}, where {fmt.name} spaces values "
                       f"{ulp:g} apart: the phase is off by up to {ulp / 2:g} rad (more "
                       "mantissa bits than the format has)")
    b = d.get("below_normal_fraction", 0.0)
    if b >= 0.01:
        out.append(f"{100 * b:.0f}% of its float32 values are below {fmt.name}'s smallest "
                   f"normal {fmt.smallest_normal:.3g} (fewer significant bits, or zero)")
    a = d.get("above_max_fraction", 0.0)
    if a > 0:
        out.append(f"{100 * a:.2g}% of its float32 values exceed {fmt.name}'s max {fmt.max:g}")
    r = d.get("dynamic_range_binades", 0.0)
    span = math.log2(fmt.max / fmt.smallest_normal)
    if r > span:
        out.append(f"its values span {r:.0f} binades; {fmt.name}'s normal range has {span:.0f}")
    e2e = layer.sqnr_db_end_to_end
    jump, e2e_in = layer.drift_jump_db, layer.sqnr_db_end_to_end_in
    if _finite(jump) and jump >= JUMP_DB and _finite(e2e) and _finite(e2e_in):  # type: ignore
        out.append(f"the end-to-end drift jumps across it: SQNR against the float32 run "
                   f"falls {jump:.0f} dB, from {e2e_in:.1f} dB at its inputs to {e2e:.1f} dB "
                   "at its output")
    if _finite(layer.grad_sqnr_db) and _finite(e2e) and \
            layer.grad_sqnr_db < e2e - 10:  # type: ignore[operator]
        out.append(f"its gradient fares worse than its output: grad SQNR "
                   f"{layer.grad_sqnr_db:.1f} dB against {e2e:.1f} dB end to end")
    return out


def _pattern(name: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def fp32_groups(audit: PrecisionAudit) -> list[tuple[str, list[str]]]:
    """The smallest set to keep in float32: (name or sibling pattern, instances).

    A pattern over numbered siblings (``blocks.*.rope``) is used only when every audited module
    it matches stands out; otherwise the instances are named one by one.
    """
    out = [x for x in audit.layers if x.stands_out]
    groups: dict[str, list[str]] = {}
    for layer in out:
        groups.setdefault(_pattern(layer.module), []).append(layer.module)
    result = []
    for pattern, names in groups.items():
        matching = [x.module for x in audit.layers if _pattern(x.module) == pattern]
        if len(names) > 1 and len(matching) == len(names) and pattern not in names:
            result.append((pattern, names))
        else:
            result += [(n, [n]) for n in names]
    return result


def recommend(audit: PrecisionAudit,
              check: Callable[[list[str]], tuple[float | None, float | None]],
              *, half_model: str | None = None, device: str = "cuda",
              ) -> Recommendation | None:
    """One ``fp32_module`` recommendation for the standouts, or None when none stands out.

    ``check(modules)`` gives the mean relative loss error against float32 over the audited
    batches, without and with those modules in float32."""
    groups = fp32_groups(audit)
    if not groups:
        return None
    fmt = get_format(audit.target)
    modules = [m for _, names in groups for m in names]
    by_name = {x.module: x for x in audit.layers}
    worst = min((by_name[m] for m in modules), key=lambda x: x.sqnr_db)  # type: ignore[arg-type]
    others = [x.sqnr_db for x in audit.layers if x.rank is not None and not x.stands_out
              and _finite(x.sqnr_db)]
    evidence = [
        f"{m}: SQNR {by_name[m].sqnr_db:.1f} dB in {fmt.name}"
        + (f", end to end {by_name[m].sqnr_db_end_to_end:.1f} dB"
           if _finite(by_name[m].sqnr_db_end_to_end) else "")
        for m in modules[:6]
    ]
    if others:
        evidence.append(f"the other ranked layers: median {statistics.median(others):.1f} dB "
                        f"(threshold {audit.threshold_db:.1f} dB)")
    evidence += worst.reasons[:3]
    # each group in float32 with its output cast back to the model's own half dtype: the
    # spec --fix installs, and the snippet fixspec writes for it (one generator for both)
    spec = FixSpec("fp32", tuple(p for p, _ in groups))
    code = snippet([spec], SnippetContext(device=device, low=half_model))
    before, after = check(modules)
    rec = Recommendation(
        type="fp32_module", value=[p for p, _ in groups], module=groups[0][0],
        snippet=code.code, helper=code.helper, fix=[str(spec)], code_change=False,
        evidence=evidence,
        data={"modules": modules, "region": [p for p, _ in groups],
              "cast_to": half_model, "source": "audit", "target": fmt.name,
              "loss_error_before": before, "loss_error_after": after})
    what = (f"re-ran the {audit.steps} audited batch{'es' if audit.steps != 1 else ''} with "
            f"{', '.join(p for p, _ in groups)} in float32 (weights of the last audited step)")
    if before is None or after is None:
        rec.verification = f"not checked: {what} gave no loss to compare"
    elif after <= before * VERIFY_FACTOR:
        rec.verified = True
        rec.verification = (f"checked: {what}: the loss's mean relative error against float32 "
                            f"went from {before:.3g} to {after:.3g}; longer training was not "
                            "re-run")
    else:
        rec.verification = (f"did not help enough: {what}: the loss's mean relative error went "
                            "from "
                            f"{before:.3g} to {after:.3g} (needs at most "
                            f"{VERIFY_FACTOR:g}x)")
    return rec
