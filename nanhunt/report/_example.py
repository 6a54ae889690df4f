"""A realistic hand-built trace: an FP16 forward overflow in a T5-style FFN.

Used by the report tests, the screenshot script and the docs, so that every renderer can be seen
on a trace that looks like a real one without running torch.
"""

from __future__ import annotations

import math

from nanhunt.formats import get_format
from nanhunt.trace import (
    Failure,
    Finding,
    LayerStats,
    OpRecord,
    Recommendation,
    RunInfo,
    ScalerEvent,
    StepRecord,
    TensorStats,
    Trace,
)

__all__ = ["example_trace"]

_FP16 = get_format("float16")
_SHAPE = [8, 128, 512]
_NUMEL = 8 * 128 * 512
_SRC = "models/t5.py:88"


def _hist(lo: int, hi: int, numel: int, peak: float | None = None) -> dict[int, int]:
    """A bell-shaped exponent histogram over binades lo..hi holding ``numel`` values."""
    mid = peak if peak is not None else (lo + hi) / 2
    width = max((hi - lo) / 4, 1.0)
    weights = {e: math.exp(-(((e - mid) / width) ** 2) / 2) for e in range(lo, hi + 1)}
    total = sum(weights.values())
    return {e: max(1, round(numel * w / total)) for e, w in weights.items()}


def _stats(
    amin: float,
    amax: float,
    *,
    dtype: str = "float16",
    shape: list[int] | None = None,
    nan: int = 0,
    posinf: int = 0,
    neginf: int = 0,
    zero: int = 0,
) -> TensorStats:
    shape = shape or _SHAPE
    numel = math.prod(shape)
    lo, hi = math.floor(math.log2(amin)), math.floor(math.log2(amax))
    finite = numel - nan - posinf - neginf - zero
    hist = _hist(lo, hi, finite, peak=hi - 3)
    underflow = sum(c for e, c in hist.items() if e < _FP16.min_normal_binade)
    flushed = sum(c for e, c in hist.items() if e < _FP16.min_subnormal_binade)
    nonfinite = nan + posinf + neginf
    return TensorStats(
        dtype=dtype,
        shape=shape,
        numel=numel,
        nan=nan,
        posinf=posinf,
        neginf=neginf,
        zero=zero,
        amax=amax,
        amin=amin,
        overflow=0,  # finite values above the max; the non-finite ones are counted apart
        underflow=underflow,
        flushed=flushed,
        headroom=-math.inf if nonfinite else _FP16.headroom_binades(amax),
        hist=hist,
    )


# module, type, forward (amin, amax), backward (amin, amax)
_LAYERS: list[tuple[str, str, tuple[float, float], tuple[float, float]]] = [
    ("embed", "Embedding", (2.1e-4, 3.9), (3.0e-7, 0.8)),
    ("encoder.blocks.0.attn", "SelfAttention", (1.2e-5, 41.0), (6.0e-8, 2.4)),
    ("encoder.blocks.0.norm", "LayerNorm", (9.0e-5, 12.5), (2.2e-7, 3.1)),
    ("encoder.blocks.0.ffn.wi", "Linear", (3.1e-5, 96.0), (1.6e-7, 5.0)),
    ("encoder.blocks.0.ffn.act", "GELU", (0.0, 95.5), (1.0e-7, 5.2)),
    ("encoder.blocks.0.ffn.wo", "Linear", (7.6e-4, 31200.0), (4.1e-8, 1.7)),
    ("encoder.blocks.1.attn", "SelfAttention", (2.0e-5, 880.0), (5.2e-8, 3.3)),
    ("encoder.blocks.1.norm", "LayerNorm", (1.1e-4, 14.1), (2.6e-7, 3.9)),
    ("encoder.blocks.1.ffn.wi", "Linear", (4.4e-5, 212.0), (1.9e-7, 7.5)),
    ("encoder.blocks.1.ffn.act", "GELU", (0.0, 210.0), (1.5e-7, 7.4)),
    ("encoder.blocks.1.ffn.wo", "Linear", (1.9e-3, 65504.0), (8.0e-8, 2.9)),
    ("final_norm", "LayerNorm", (1.5e-4, 16.0), (1.3e-6, 410.0)),
    ("lm_head", "Linear", (3.3e-4, 52.0), (2.0e-6, 30500.0)),
]

_FWD_PEAKS = {
    "encoder.blocks.0.ffn.wo": [9800.0, 14100.0, 22500.0, 31200.0, 30100.0, 29800.0],
    "encoder.blocks.1.ffn.wo": [17400.0, 28800.0, 51200.0, math.inf, math.inf, math.inf],
}


def _layer(name: str, type_: str, fwd: tuple[float, float], bwd: tuple[float, float]) -> LayerStats:
    amin, amax = fwd
    zero = _NUMEL // 2 if type_ == "GELU" else 0
    amin = amin or 3.0e-8
    nonfinite: dict[str, int] = {}
    if name == "encoder.blocks.1.ffn.wo":
        nonfinite = {"posinf": 37, "neginf": 5}
    elif name in ("final_norm", "lm_head"):
        nonfinite = {"nan": _NUMEL // 4}
    forward = _stats(amin, amax, zero=zero, **nonfinite)
    backward = _stats(bwd[0], bwd[1])
    peaks = _FWD_PEAKS.get(name) or [amax * f for f in (0.55, 0.7, 0.85, 1.0, 0.97, 0.95)]
    return LayerStats(
        module=name,
        type=type_,
        calls=6,
        dtypes=["float16"],
        forward=forward,
        backward=backward,
        forward_amax_by_step=dict(enumerate(peaks)),
        backward_amax_by_step={i: bwd[1] * f for i, f in enumerate((1.0, 0.9, 0.6, 0.5, 0.5))},
    )


_FFN_WO_SNIPPET = '''import torch
from torch import nn


class FP32(nn.Module):
    """Run the wrapped module in float32 under autocast, cast back after."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.inner(x.float())


for block in model.encoder.blocks:
    # keep the FFN output and the following norm in float32
    block.ffn.wo = FP32(block.ffn.wo)
    block.norm = FP32(block.norm)'''


def example_trace() -> Trace:
    """The T5-style overflow: ``encoder.blocks.1.ffn.wo`` overflows FP16 in step 3's forward.

    >>> example_trace().first_failure.module
    'encoder.blocks.1.ffn.wo'
    """
    culprit_stats = _stats(1.9e-3, 65504.0, posinf=37, neginf=5)
    steps = [
        StepRecord(0, loss=10.82, scale=65536.0, skipped=True, grad_norm=None, records=412),
        StepRecord(1, loss=10.61, scale=32768.0, skipped=True, grad_norm=None, records=412),
        StepRecord(2, loss=9.97, scale=16384.0, skipped=False, grad_norm=3.42, records=412),
        StepRecord(3, loss=math.nan, scale=16384.0, skipped=True, nonfinite=True, records=412),
        StepRecord(4, loss=math.nan, scale=8192.0, skipped=True, nonfinite=True, records=412),
        StepRecord(5, loss=math.nan, scale=4096.0, skipped=True, nonfinite=True, records=412),
    ]
    return Trace(
        run=RunInfo(
            command=["nanhunt", "diagnose", "train_t5.py", "--lr", "3e-4", "--batch", "8"],
            script="train_t5.py",
            python="3.11.7",
            torch="2.4.1+cu121",
            nanhunt="0.1.0",
            platform="Linux-6.5.0-x86_64",
            device="cuda:0 (NVIDIA A100-SXM4-40GB)",
            dtypes=["float16", "float32"],
            target="float16",
            world_size=1,
            autocast=True,
            scaler=True,
            started="2024-09-12T14:03:11Z",
            finished="2024-09-12T14:03:52Z",
            status="complete",
            exit_code=0,
        ),
        steps=steps,
        layers=[_layer(*spec) for spec in _LAYERS],
        first_failure=Failure(
            step=3,
            phase="forward",
            module="encoder.blocks.1.ffn.wo",
            tensor="output",
            stats=culprit_stats,
            op="aten::addmm",
            source="models/t5.py:88",
            source_line="return self.wo(self.dropout(self.act(self.wi(x))))",
            detail="inputs finite (amax 210); the matmul's fp16 result exceeds 65504",
        ),
        problem=True,
        diagnosis=Finding(
            rule="forward-overflow",
            kind="overflow",
            severity="error",
            message=(
                "encoder.blocks.1.ffn.wo's output exceeds float16's max (65504) in the forward "
                "pass. GradScaler cannot help: it only scales gradients."
            ),
            evidence=[
                "output amax grew 1.74e+04 → 2.88e+04 → 5.12e+04 over steps 0-2, then inf at "
                "step 3",
                "its input (encoder.blocks.1.ffn.act) is finite with amax 210; aten::addmm "
                "produced the first inf",
                "sibling encoder.blocks.0.ffn.wo peaks at 3.12e+04: 1.1 binades of headroom",
                "loss scale fell 65536 → 2048 while 5 of 6 steps were skipped",
            ],
            phase="forward",
            step=3,
            module="encoder.blocks.1.ffn.wo",
            tensor="output",
            score=10.0,
        ),
        warnings=[
            Finding(
                rule="underflow",
                kind="underflow",
                severity="warning",
                message="31% of encoder.blocks.0.ffn.wo's output gradients are subnormal in "
                "float16",
                evidence=["backward amin 4.1e-08 at scale 16384"],
                phase="backward",
                module="encoder.blocks.0.ffn.wo",
                score=0.35,
            ),
            Finding(
                rule="near-overflow",
                kind="overflow",
                severity="warning",
                message="forward amax 3.12e+04 is 1.1 binades below float16's max",
                evidence=["same class and position as the culprit in the previous block"],
                phase="forward",
                module="encoder.blocks.0.ffn.wo",
                score=0.9,
            ),
            Finding(
                rule="scale-falling",
                kind="loss_scale",
                severity="warning",
                message="loss scale halved 5 times in 6 steps",
                evidence=["backoffs at steps 0, 1, 3, 4, 5"],
                phase="loss_scaling",
                score=0.6,
            ),
        ],
        recommendations=[
            Recommendation(
                type="fp32_module",
                value="encoder.blocks.*.ffn.wo",
                module="encoder.blocks.*.ffn.wo",
                snippet=_FFN_WO_SNIPPET,
                evidence=[
                    "2 of 2 ffn.wo instances are within 1.1 binades of 65504",
                    "the float32 output (amax 8.1e+04) comes back into range after the norm",
                ],
                verified=True,
                verification="verified by re-run: 9 steps, loss 2.31 -> 1.97, all finite; "
                "no skipped step; scale 16384 -> 16384",
                fix=["fp32:encoder.blocks.*.ffn.wo..norm"],
                check="rerun",
                replay="replayed step 3 with ffn.wo and norm in float32, cast back after the "
                "norm: no inf, output amax 16.2",
            ),
            Recommendation(
                type="init_scale",
                value=4096.0,
                snippet='scaler = torch.amp.GradScaler("cuda", init_scale=4096.0)',
                evidence=[
                    "at 2^16: 0.8% of gradient values overflow",
                    "at 2^12: none overflow, 0.02% flush to zero",
                ],
                verified=False,
                verification="not verified: not re-run (another fix was verified first)",
                fix=["init-scale=4096"],
            ),
            Recommendation(
                type="clip_grad_norm",
                value=1.0,
                snippet=(
                    "scaler.unscale_(optimizer)\n"
                    "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
                    "scaler.step(optimizer)"
                ),
                evidence=["gradient norm 3.42 at the last clean step"],
                verified=False,
                verification="not verified: not re-run (another fix was verified first)",
                fix=["clip=1"],
            ),
        ],
        facts=[
            "step 0: 12 inf in lm_head's output gradient at scale 65536; GradScaler skipped "
            "the step (normal at the start)",
            "step 1: 3 inf in lm_head's output gradient at scale 32768; GradScaler skipped the "
            "step",
        ],
        scaler_events=[
            ScalerEvent(0, "backoff", 65536.0, 32768.0),
            ScalerEvent(1, "backoff", 32768.0, 16384.0),
            ScalerEvent(3, "backoff", 16384.0, 8192.0),
            ScalerEvent(4, "backoff", 8192.0, 4096.0),
            ScalerEvent(5, "backoff", 4096.0, 2048.0),
        ],
        ops=[
            OpRecord(
                0, "aten::view", "forward", "float16", 210.0, 0, _NUMEL * 4, "models/t5.py:88"
            ),
            OpRecord(1, "aten::t", "forward", "float16", 0.94, 0, 2048 * 512, _SRC),
            OpRecord(
                2,
                "aten::addmm",
                "forward",
                "float16",
                math.inf,
                42,
                _NUMEL,
                "models/t5.py:88",
                first_nonfinite=True,
            ),
            OpRecord(
                3, "aten::view", "forward", "float16", math.inf, 42, _NUMEL, "models/t5.py:88"
            ),
            OpRecord(
                4,
                "aten::native_layer_norm",
                "forward",
                "float16",
                math.nan,
                _NUMEL // 4,
                _NUMEL,
                "models/t5.py:91",
            ),
        ],
        snapshot="culprit-step3.pt",
        grad_hist={"float32": _hist(-34, 0, 2_400_000, peak=-15)},
    )
