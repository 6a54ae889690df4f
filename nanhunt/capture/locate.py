"""Find the origin of a problem among one step's records. Torch-free.

The rule (docs/what-counts.md): a step has a *problem* when the loss, a gradient that reaches the
optimizer, a parameter, or a root module's output becomes non-finite (or the loss scale
collapses, judged across steps by the capture). The *origin* is the first non-finite value in
execution order that is on the path to the problem: a non-finite forward value is *absorbed*
when every module call that consumed it still produced finite (or itself absorbed) outputs, as a
``-inf`` attention mask is absorbed by the softmax that reads it. Absorbed values are facts, not
origins. One-signed ``-inf`` inputs made outside any module (masks, sentinels) are considered
only when nothing else explains the problem.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Rec", "find_origin", "is_absorbed"]

FORWARD_PHASES = ("data", "forward")


@dataclass
class Rec:
    """The facts :func:`find_origin` needs about one recorded tensor."""

    index: int  # position in the caller's list
    order: int
    phase: str
    role: str
    nonfinite: bool
    one_sided_neginf: bool = False  # only -inf, no NaN, no +inf
    allowed: bool = False  # matched the user's allow_inf patterns
    producer: int | None = None  # call id that produced it (outputs)
    parent: int | None = None  # call id active when it was produced (None: top level)
    consumers: list[int] = field(default_factory=list)  # call ids that took it as input
    also_producers: list[int] = field(default_factory=list)  # containers that returned it


def _call_outputs(recs: Sequence[Rec]) -> dict[int, list[Rec]]:
    out: dict[int, list[Rec]] = {}
    for r in recs:
        if r.producer is not None and r.role == "output":
            for call in (r.producer, *r.also_producers):
                out.setdefault(call, []).append(r)
    return out


def is_absorbed(
    rec: Rec,
    outputs: dict[int, list[Rec]],
    parents: dict[int, int | None],
    loss_finite: bool | None,
    memo: dict[int, bool] | None = None,
) -> bool:
    """Whether a non-finite forward value was consumed without harm (see the module doc)."""
    if rec.phase not in FORWARD_PHASES or not rec.nonfinite:
        return False
    memo = {} if memo is None else memo

    def call_ok(call: int | None, depth: int = 0) -> bool:
        if call is None:
            return bool(loss_finite)
        key = -call - 1
        if key in memo:
            return memo[key]
        memo[key] = False  # cycle guard
        outs = outputs.get(call, [])
        if outs:
            ok = all(not o.nonfinite or absorbed(o, depth + 1) for o in outs)
        else:  # a call with no float output: judge by where its result went
            ok = call_ok(parents.get(call), depth + 1)
        memo[key] = ok
        return ok

    def absorbed(r: Rec, depth: int) -> bool:
        if depth > 200:
            return False
        if r.index in memo:
            return memo[r.index]
        memo[r.index] = False
        if r.consumers:
            ok = all(call_ok(c, depth) for c in r.consumers)
        else:
            ok = call_ok(r.parent, depth)
        memo[r.index] = ok
        return ok

    return absorbed(rec, 0)


def find_origin(
    recs: Sequence[Rec],
    parents: dict[int, int | None],
    loss_finite: bool | None,
) -> Rec | None:
    """The first non-finite record on the path to a problem, in execution order."""
    outputs = _call_outputs(recs)
    memo: dict[int, bool] = {}
    candidates = []
    for r in sorted(recs, key=lambda r: r.order):
        if not r.nonfinite or r.allowed:
            continue
        if is_absorbed(r, outputs, parents, loss_finite, memo):
            continue
        candidates.append(r)
    for r in candidates:
        # an input that is only -inf, fed to a module, is most likely a mask that went wrong
        # later; a later record explains more. A loss's target (no module consumes it) is data.
        if not (r.one_sided_neginf and r.role == "input" and r.consumers):
            return r
    return candidates[0] if candidates else None
