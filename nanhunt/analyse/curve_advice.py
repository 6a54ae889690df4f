"""Advice for failures without a NaN (the rules of ``diagnose/curves.py``). Torch-free.

Each builder reads one finding and the trace's signals and returns a recommendation with its
values computed: the learning rate from the param group's update-to-weight ratio, a warm-up
length from Adam's second-moment horizon, a z-loss coefficient, clipping from healthy gradient
norms, a soft cap from the attention logits' healthy range. The installable ones are ``--fix``
specs (``lr-factor``, ``clip``, ``fp32-master``, ``zloss``, ``cap``, ``warmup``) that re-run
verification tries; qk-layernorm and float32 master weights made by the code are snippets,
not verified.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from nanhunt.analyse.diagnose import Context
from nanhunt.analyse.diagnose.curves import (
    LOGIT_LIMIT,
    UPDATE_RATIO_TARGET,
    Z_LOSS,
    group_ratios,
    losses,
)
from nanhunt.trace import Finding, Recommendation, Trace

__all__ = ["CURVE_ADVICE", "logit_cap", "lr_from_update_ratio", "warmup_steps", "z_loss_coef"]

#: Adam's beta2 when nothing else is known (torch's default)
_BETA2 = 0.999


def lr_from_update_ratio(lr: float, ratio: float, target: float = UPDATE_RATIO_TARGET) -> float:
    """The factor (a power of ten, 1e-4 to 0.1) that brings an update-to-weight ratio to about
    ``target``: an optimizer's update scales with its lr (Adam's exactly, SGD's for a given
    gradient), so lr x target / ratio, rounded down to a power of ten."""
    if ratio <= 0 or not math.isfinite(ratio):
        return 0.1
    f = target / ratio
    return max(1e-4, min(0.1, 10.0 ** math.floor(math.log10(f))))


def z_loss_coef(healthy: float, grown: float, loss_first: float, loss_grown: float,
                default: float = Z_LOSS) -> tuple[float, float, float]:
    """(the coefficient, the smallest that pushes back, the largest that leaves healthy training
    alone): the z term is about coef x logsumexp(logits)^2, at least coef x max|logit|^2 once
    the logits are large. It should reach the loss at the logits the run grew to (coef x grown^2
    >= the loss there) and stay under 1% of the loss at its first, healthy logits (coef x
    healthy^2 <= 0.01 x the first loss). ``default`` (PaLM's 1e-4) clamped into that range by
    powers of ten; the default when the range is empty."""
    low = loss_grown / grown ** 2 if grown > 0 else 0.0
    high = 0.01 * loss_first / max(healthy, 1.0) ** 2
    coef = default
    if 0 < low <= high:
        if coef < low:
            coef = 10.0 ** math.ceil(math.log10(low))
        elif coef > high:
            coef = 10.0 ** math.floor(math.log10(high))
    return float(f"{coef:.3g}"), low, high


def logit_cap(healthy: float) -> float:
    """A soft cap for attention logits whose first, healthy largest value was ``healthy``: 4x
    it (cap x tanh(x / cap) keeps 98% of a logit a quarter of the cap), at least 20 (a spread
    of 40 between capped extremes is e^-40: no softmax needs more), rounded up to 1, 2 or 5
    times a power of ten."""
    want = max(4.0 * healthy, 20.0)
    base = 10.0 ** math.floor(math.log10(want))
    return next(m * base for m in (1.0, 2.0, 5.0, 10.0) if m * base >= want * (1 - 1e-12))


def warmup_steps(beta2: float = _BETA2) -> int:
    """Steps of linear warm-up for an Adam-type optimizer: 2 / (1 - beta2), the horizon over
    which its second-moment estimate becomes reliable (Ma & Yarats 2021, "On the adequacy of
    untuned warmup for adaptive optimization"); 2000 at torch's default beta2=0.999."""
    return round(2 / (1 - beta2))


def _device(trace: Trace) -> str:
    d = (trace.run.device or "cpu").split(":")[0].split(",")[0].strip()
    return d if d in ("cpu", "cuda", "xpu", "mps", "hpu") else "cuda"


def _group(finding: Finding) -> tuple[str | None, float | None, float | None]:
    d = finding.data
    return d.get("group"), d.get("update_ratio"), d.get("lr")


def _lower_lr(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    group, ratio, lr = _group(finding)
    if ratio is None or ratio < 10 * UPDATE_RATIO_TARGET:
        return None
    factor = lr_from_update_ratio(lr or 1.0, ratio)
    pts = group_ratios(trace, finding.step if finding.step is not None else math.inf).get(
        group or "", [])
    evidence = [f"param group {group}: each update changed its weights by a median {ratio:.2g} "
                f"of their norm over steps {pts[0][0]}-{pts[-1][0]}" if pts else
                f"param group {group}: update-to-weight ratio {ratio:.2g}",
                f"x{factor:g} brings that to about {ratio * factor:.2g} (about "
                f"{UPDATE_RATIO_TARGET:g} is healthy; the update scales with the lr)"]
    if lr:
        evidence.append(f"lr {lr:g} -> {lr * factor:g}")
    return Recommendation(type="lower_lr", value=factor, module=finding.module,
                          snippet="", evidence=evidence,
                          data={"group": group, "update_ratio": ratio, "lr": lr})


def _lower_lr_jump(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    """After an update that replaced the weights: the cut that brings it to a healthy share of
    the weights it started from (known after the first step), else the least cut."""
    d = finding.data
    group, lr, before = d.get("group"), d.get("lr"), d.get("weights_before")
    update = d.get("update_norm")
    if not update or not math.isfinite(update):
        return None
    if before:
        # unbounded below (unlike a ratio measured over healthy steps): an update that replaced
        # the weights tells how far the lr is off, by many powers of ten at lr 1e20
        factor = min(0.1, 10.0 ** math.floor(math.log10(UPDATE_RATIO_TARGET * before / update)))
        evidence = [f"param group {group}: the update's norm {update:.3g} against the weights' "
                    f"norm {before:.3g} before it",
                    f"x{factor:g} brings the update to about {UPDATE_RATIO_TARGET:g} of the "
                    "weights (the update scales with the lr)"]
    else:
        factor = UPDATE_RATIO_TARGET
        evidence = [f"param group {group}: the update at the first step replaced the weights "
                    "(nanhunt does not measure the weights before the first update), so "
                    f"x{factor:g} is the least cut; a larger one may be needed"]
    if lr:
        evidence.append(f"lr {lr:g} -> {lr * factor:g}")
    return Recommendation(type="lower_lr", value=factor, module=None, snippet="",
                          evidence=evidence, data={"group": group, "lr": lr})


def _warmup(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    if finding.kind not in ("lr_too_high", "logit_growth"):
        return None
    adam = any(o.type in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax") for o in trace.optimizers)
    warm = [s.lr for s in sorted(trace.steps, key=lambda s: s.index)[:5] if s.lr is not None]
    if len(set(warm)) > 1 and warm == sorted(warm):
        return None  # the lr already warms up
    beta2 = next((o.beta2 for o in trace.optimizers if o.beta2 is not None), None)
    n = warmup_steps(beta2 if beta2 is not None and 0 < beta2 < 1 else _BETA2)
    why = (f"Adam's second-moment estimate needs about 2 / (1 - beta2) = {n} steps (beta2 "
           f"{beta2 if beta2 is not None else _BETA2:g}"
           + ("" if beta2 is not None else ", torch's default: the script's was not recorded")
           + ") before its steps are as small as they will be (Ma & Yarats 2021)" if adam else
           f"{n} steps, the untuned rule of thumb for adaptive optimizers; shorter may do")
    run = len(trace.steps)
    evidence = [f"the lr was the same from the first step ({warm[0]:g})" if warm else
                "no warm-up was seen", why,
                "a post-LN transformer needs warm-up to train at all (Xiong et al. 2020)"]
    if n > run:
        evidence.append(f"longer than this run ({run} steps): it ran at most "
                        f"{run / n:.2g} of its lr")
    return Recommendation(type="lr_warmup", value=n, snippet="", evidence=evidence,
                          data={"beta2": beta2})


def _qk_layernorm(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    if finding.kind != "logit_growth" or finding.data.get("signal") != "attention_logit" \
            or not finding.module:
        return None
    m = finding.module
    snippet = "\n".join([
        "from torch import nn",
        "",
        f"# in the attention module {m} (its class's __init__), for head_dim = d_model // heads:",
        "self.q_norm = nn.LayerNorm(head_dim)",
        "self.k_norm = nn.LayerNorm(head_dim)",
        "# in its forward, after splitting the heads and before q @ k.transpose(-2, -1):",
        "q, k = self.q_norm(q), self.k_norm(k)",
    ])
    return Recommendation(
        type="qk_layernorm", value=None, module=m, snippet=snippet, code_change=True,
        verification="not verified: a change to the model's code",
        evidence=[f"the attention logits in {m} grew from {finding.data.get('from', 0):.3g} to "
                  f"{finding.data.get('to', 0):.3g}: they are products of queries and keys whose "
                  "norms grow with the weights",
                  "normalising queries and keys bounds every logit by the LayerNorm gains, "
                  "the fix Wortsman et al. (2023) and Dehghani et al. (2023, ViT-22B) use"])


def _loss_at(trace: Trace, step: int | None) -> float | None:
    pts = losses(trace)
    if not pts:
        return None
    if step is None:
        return pts[-1][1]
    return min(pts, key=lambda p: abs(p[0] - step))[1]


def _z_loss(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    if finding.kind != "logit_growth" or finding.data.get("signal") != "output_logit" \
            or not finding.module:
        return None
    healthy, grown = float(finding.data.get("from") or 0), float(finding.data.get("to") or 0)
    pts = losses(trace)
    first = pts[0][1] if pts else 1.0
    at = _loss_at(trace, finding.data.get("crossed_step", finding.step)) or first
    coef, low, high = z_loss_coef(healthy, grown, first, at)
    evidence = [f"the output logits of {finding.module} grew from {healthy:.3g} to {grown:.3g}",
                "a z-loss adds coef x logsumexp(logits)^2 to the loss: it keeps the softmax's "
                "normaliser near 0, so the logits cannot drift (PaLM; Wortsman et al. 2023)"]
    if 0 < low <= high:
        evidence.append(f"coef {coef:g}: at the logits the run reached the term is at least "
                        f"{coef * grown ** 2:.3g} (the loss there: {at:.3g}; it pushes back "
                        f"from coef {low:.2g}); at its first logits it is at most about "
                        f"{coef * max(healthy, 1.0) ** 2:.2g}, under 1% of the first loss "
                        f"{first:.3g} (up to coef {high:.2g})")
    else:
        evidence.append(f"coef {coef:g} (PaLM's): the logits did not grow far enough past "
                        "their first values to compute one from this run")
    return Recommendation(type="z_loss", value=coef, module=finding.module, snippet="",
                          evidence=evidence, data={"from": healthy, "to": grown})


def _logit_cap(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    if finding.kind != "logit_growth" or finding.data.get("signal") != "attention_logit" \
            or not finding.module:
        return None
    healthy = float(finding.data.get("from") or 0)
    cap = logit_cap(healthy)
    return Recommendation(
        type="logit_cap", value=cap, module=finding.module, snippet="",
        evidence=[f"the attention logits in {finding.module} grew from {healthy:.3g} to "
                  f"{float(finding.data.get('to') or 0):.3g}; above {LOGIT_LIMIT:g} apart a "
                  "softmax is one-hot and passes no gradient",
                  f"a soft cap cap x tanh(x / cap) at {cap:g} (4x the first largest logit, at "
                  "least 20) bounds them and leaves the healthy ones nearly as they were "
                  "(Gemma 2 caps attention logits at 50)",
                  "qk-layernorm removes the cause; the cap is the fix nanhunt can install and "
                  "verify by re-running the script"],
        data={"from": healthy})


def _fp32_weights(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    if finding.rule != "loss-stall" or not finding.data.get("dtypes"):
        return None
    dtypes = finding.data["dtypes"]
    low = "bfloat16" if "bfloat16" in dtypes else "float16"
    snippet = "\n".join([
        "import torch",
        "",
        f"model = model.float()  # master weights in float32: drop model.to(torch.{low})",
        "optimizer = torch.optim.Adam(model.parameters(), lr=lr)  # made after .float()",
        "# in the training loop: the forward still computes in the low-precision format",
        f'with torch.autocast("{_device(trace)}", dtype=torch.{low}):',
        "    loss = loss_fn(model(inputs), targets)",
    ])
    return Recommendation(
        type="fp32_master_weights", value=finding.data.get("group"), snippet=snippet,
        code_change=True, verification="not verified: a change to the code",
        evidence=[f"the weights of {finding.data.get('group')} are {'/'.join(dtypes)}: an update "
                  "smaller than half a unit in their last place is lost",
                  "float32 master weights keep every update; autocast still computes in the "
                  "low-precision format"],
        data={"dtype": dtypes[0]})


def _clip(trace: Trace, ctx: Context, finding: Finding) -> Recommendation | None:
    if finding.kind != "exploding_gradient":
        return None
    norms = [v for _, v in ctx.grad_norms()]
    if len(norms) < 3:
        return None
    value = float(f"{statistics.median(norms[: max(3, len(norms) // 4)]) * 2:.2g}")
    return Recommendation(
        type="clip_grad_norm", value=value, snippet="",
        evidence=[f"twice the median gradient norm of the first {max(3, len(norms) // 4)} "
                  f"steps: max_norm={value:g}"])


Builder = Callable[[Trace, Context, Finding], Recommendation | None]

#: rule id -> builders, most relevant first (merged into advise.ADVICE)
CURVE_ADVICE: dict[str, tuple[Builder, ...]] = {
    "logit-growth": (_qk_layernorm, _logit_cap, _z_loss, _lower_lr, _warmup),
    "loss-divergence": (_qk_layernorm, _logit_cap, _z_loss, _lower_lr, _clip, _warmup),
    "update-jump": (_lower_lr_jump,),
    "loss-spike": (_qk_layernorm, _logit_cap, _z_loss, _lower_lr, _clip, _warmup),
    "loss-stall": (_fp32_weights,),
    "loss-plateau": (_qk_layernorm, _logit_cap, _z_loss, _warmup),
    "post-ln-warmup": (_warmup, _lower_lr),
}
