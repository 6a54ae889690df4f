"""Diagnosis: small pure rules over a recorded :class:`~nanhunt.trace.Trace`. Torch-free.

Every rule is a function registered with :func:`rule` under a stable id, with the kind it
diagnoses, a one-line description (its docstring's first line) and the parts of the trace it
needs. :data:`RULES` lists them in the order they run; docs/rules.md is the catalogue.

:func:`diagnose` runs every rule and fills ``trace.diagnosis`` (the one finding with severity
``"error"`` that explains the first failure, chosen by :data:`PRECEDENCE`) and ``trace.warnings``
(ranked by score, worst first). Every number in a finding's evidence is read from the trace.

>>> from nanhunt.trace import Trace
>>> trace = Trace()
>>> diagnose(trace)
>>> trace.diagnosis is None, trace.warnings
(True, [])
"""

from __future__ import annotations

import math

from nanhunt.analyse.diagnose._base import (
    ALWAYS_PRIMARY,
    DEMOTED_SCORE,
    ERROR_SCORE,
    KINDS,
    PRECEDENCE,
    RULES,
    SUPERSEDES,
    Context,
    Rule,
    ScaleFractions,
    Thresholds,
    _counts,
    eps_in_format,
    is_loss_type,
    is_norm_type,
    is_sentinel,
    module_pattern,
    rule,
    scale_fractions,
)
from nanhunt.analyse.diagnose.classify import _where, failure_op
from nanhunt.trace import Finding, Trace

__all__ = [
    "KINDS",
    "PRECEDENCE",
    "RULES",
    "Context",
    "Rule",
    "ScaleFractions",
    "Thresholds",
    "diagnose",
    "eps_in_format",
    "failure_op",
    "is_loss_type",
    "is_norm_type",
    "is_sentinel",
    "module_pattern",
    "rule",
    "scale_fractions",
]


# ----------------------------------------------------------------------------- diagnose


def _untraced_failure(ctx: Context) -> bool:
    """The failing step was one --sample-every did not trace: only its loss and gradient norm
    were checked, so the first non-finite value seen there is not its origin."""
    f = ctx.failure
    if f is not None and not f.observed:
        return True  # the module read weights made non-finite where nanhunt did not look
    if f is None or f.phase == "data":
        return False
    rec = ctx.steps.get(f.step)
    if rec is None or rec.traced is None or rec.traced:
        return False
    # the cheap check sees the updated parameters and the gradient norm: weights that went
    # non-finite in an update of finite gradients were observed where they were made
    return not (f.phase == "optimizer" and rec.grad_norm is not None
                and math.isfinite(rec.grad_norm))


def _diagnose_untraced(trace: Trace, ctx: Context) -> None:
    f = ctx.failure
    assert f is not None
    traced = [s.index for s in trace.steps if s.traced]
    after = [i for i in traced if i > f.step]
    evidence = [f"steps traced in full: {', '.join(str(i) for i in traced[-8:]) or 'none'}"]
    if after:
        evidence.append(f"nanhunt traced the {len(after)} steps after it in full and the failure "
                        "did not recur there")
    if not f.observed:
        message = (
            f"step {f.step} went non-finite ({_where(f)}: {_counts(f.stats)}), but {f.detail}; "
            "its origin was not observed, so no cause is named")
        evidence.insert(0, f.detail)
    else:
        message = (
            f"step {f.step} went non-finite ({_where(f)}: {_counts(f.stats)}), but it was not "
            "traced (--sample-every): its origin was not observed, so no cause is named. Run "
            f"again without --sample-every (or with --max-steps {f.step + 1}) to trace step "
            f"{f.step}")
    trace.diagnosis = Finding(
        rule="untraced-step",
        kind="",
        severity="error",
        message=message,
        evidence=evidence,
        step=f.step,
        score=ERROR_SCORE,
        data={"observed": False},
    )
    trace.warnings = []
    trace.notes.append(f"step {f.step} was not traced: the diagnosis names no cause"
                       if f.observed else
                       f"the origin of step {f.step}'s failure was not observed: the diagnosis "
                       "names no cause")


def diagnose(trace: Trace, *, strict: bool = False, thresholds: Thresholds | None = None) -> None:
    """Fill ``trace.diagnosis`` and ``trace.warnings`` from :data:`RULES`.

    The diagnosis is the error that explains ``trace.first_failure``, picked by
    :data:`PRECEDENCE`; errors that lose become warnings. Warnings are ranked by score (worst
    first) and capped at ``thresholds.max_warnings``. A rule that raises on a malformed trace
    leaves a line in ``trace.notes`` and the others still run; with ``strict`` the exception
    propagates.
    ``trace.recommendations`` is left to :func:`nanhunt.analyse.advise.advise`.
    """
    ctx = Context(trace, thresholds)
    if _untraced_failure(ctx):
        _diagnose_untraced(trace, ctx)
        return
    errors: list[Finding] = []
    warnings: list[Finding] = []
    for r in RULES:
        if not r.applicable(trace):
            continue
        try:
            found = list(r.check(trace, ctx))
        except Exception as exc:
            if strict:
                raise
            trace.notes.append(f"rule {r.id} could not run: {type(exc).__name__}: {exc}")
            continue
        for finding in found:
            finding.rule = finding.rule or r.id
            finding.kind = finding.kind or r.kind
            (errors if finding.severity == "error" else warnings).append(finding)
    primary = None
    # a misused GradScaler is a bug whether or not the run has failed yet
    if errors and (trace.first_failure is not None
                   or any(e.rule in ALWAYS_PRIMARY for e in errors)):
        rank = {rid: i for i, rid in enumerate(PRECEDENCE)}
        errors.sort(key=lambda e: rank.get(e.rule, len(rank)))
        primary = errors.pop(0)
        primary.score = ERROR_SCORE
        explained = SUPERSEDES.get(primary.rule, ())
        errors = [e for e in errors if e.rule not in explained]
    for e in errors:
        e.severity = "warning"
        e.score = max(e.score, DEMOTED_SCORE) if primary is None else DEMOTED_SCORE
        warnings.append(e)
    warnings.sort(key=lambda w: -w.score)
    trace.diagnosis = primary
    trace.warnings = warnings[: ctx.th.max_warnings]


# importing the rule modules registers their rules, in this order (the order rules run in and
# the catalogue lists them): the phases' errors, growth, warnings, then causes outside the
# failing module's arithmetic (the loop, crashes, vanished eps, unnormalised input)
# isort: off
from nanhunt.analyse.diagnose import classify, failures, growth, risks  # noqa: E402,F401
from nanhunt.analyse.diagnose import causes, curves  # noqa: E402,F401
# isort: on
