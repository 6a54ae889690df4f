"""nanhunt.analyse.advise: computed values and snippets on hand-built traces, and the pure
arithmetic.

The init_scale tests recompute the fractions by their own summation with DESIGN.md §3's float16
limits written out (overflow e + k >= 16, flushed e + k < -24, subnormal -24 <= e + k < -14).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from rich.console import Console
from torch import nn

from nanhunt.analyse.advise import (
    advise,
    choose_init_scale,
    clip_value,
    eps_in_format,
    lr_factor,
    nice_ceil,
    suggest_eps,
)
from nanhunt.analyse.diagnose import diagnose
from nanhunt.fixspec import FP32_HELPER
from nanhunt.formats import get_format
from nanhunt.trace import (
    Failure,
    LayerStats,
    OptimizerInfo,
    RunInfo,
    ScalerEvent,
    StepRecord,
    TensorStats,
    Trace,
)

FP16 = get_format("float16")
FP16_MAX = 65504.0

# --------------------------------------------------------------------------------------------
# factories
# --------------------------------------------------------------------------------------------


def stats(amax: float = 1.0, *, dtype: str = "float16", numel: int = 1024, **counts) -> TensorStats:
    return TensorStats(
        dtype=dtype,
        shape=[numel],
        numel=numel,
        amax=amax,
        headroom=math.log2(FP16_MAX / amax) if amax else math.inf,
        **counts,
    )


def layer(name, type_="Linear", *, fwd=(), bwd=(), params=(), dtype="float16", pg=None, zero=0):
    fwd_d = dict(enumerate(fwd))
    return LayerStats(
        module=name,
        type=type_,
        calls=len(fwd_d),
        dtypes=[dtype],
        forward=stats(max(fwd, default=0.0), dtype=dtype, zero=zero),
        param_grad=pg,
        forward_amax_by_step=fwd_d,
        backward_amax_by_step=dict(enumerate(bwd)),
        param_amax_by_step=dict(enumerate(params)),
    )


def trace_of(layers, n, *, fail=None, scaler=False, scale=None, skipped=(), norms=None, **kw):
    steps = [
        StepRecord(
            index=i,
            loss=1.0,
            scale=scale,
            skipped=i in skipped,
            grad_norm=norms[i] if norms is not None else 1.0,
        )
        for i in range(n)
    ]
    # a run of these steps stepped an optimizer (a script without one gets no optimizer fix)
    kw.setdefault("optimizers", [OptimizerInfo(type="Adam", eps=1e-8, name="optimizer")])
    return Trace(
        run=RunInfo(target="float16", dtypes=["float16", "float32"], scaler=scaler, device="cpu"),
        steps=steps,
        layers=list(layers),
        first_failure=fail,
        problem=fail is not None,
        **kw,
    )


def advised(trace: Trace) -> Trace:
    diagnose(trace, strict=True)
    advise(trace)
    return trace


def rec(trace: Trace, type_: str):
    found = [r for r in trace.recommendations if r.type == type_]
    assert found, f"no {type_} in {[r.type for r in trace.recommendations]}"
    return found[0]


# --------------------------------------------------------------------------------------------
# choose_init_scale against hand-computed histograms
# --------------------------------------------------------------------------------------------


def design_fractions(hist: dict[int, int], k: int) -> tuple[float, float, float, float]:
    """(overflow, normal, subnormal, flushed) for float16, by DESIGN.md §3's definitions."""
    total = sum(hist.values())
    over = sum(c for e, c in hist.items() if e + k >= 16)
    flushed = sum(c for e, c in hist.items() if e + k < -24)
    sub = sum(c for e, c in hist.items() if -24 <= e + k < -14)
    normal = total - over - flushed - sub
    return over / total, normal / total, sub / total, flushed / total


def as_tuple(fr) -> tuple[float, float, float, float]:
    return fr.overflow, fr.normal, fr.subnormal, fr.flushed


def test_init_scale_mass_at_one_binade():
    hist = {-20: 100}
    c = choose_init_scale(hist, FP16, 2.0**16)
    # the mass goes to binade 13, two below float16's max binade 15 (65504 = 1.999 * 2^15);
    # a third binade of headroom would keep no more mass normal
    assert c.k == 33
    assert c.scale == 2.0**33
    assert c.headroom == 2
    assert as_tuple(c.chosen) == pytest.approx(design_fractions(hist, 33))
    assert as_tuple(c.chosen) == (0.0, 1.0, 0.0, 0.0)
    assert as_tuple(c.current) == pytest.approx(design_fractions(hist, 16))


def test_init_scale_mass_spread_wide():
    hist = dict.fromkeys(range(-30, 6), 1)  # 36 values, binades -30..5
    c = choose_init_scale(hist, FP16, 2.0**16)
    # two binades of headroom: 5 + k = 13 -> k = 8 keeps -22..5 normal (28 values); one binade
    # (k = 9) keeps -23..5 (29 values): 1/36 more of the mass, above the 1% bar
    assert design_fractions(hist, 8)[1] == 28 / 36
    assert design_fractions(hist, 9)[1] == 29 / 36
    assert c.k == 9
    assert as_tuple(c.chosen) == pytest.approx(design_fractions(hist, 9))
    assert c.chosen.overflow == 0
    assert c.chosen.subnormal == pytest.approx(7 / 36)  # binades -30..-24
    assert as_tuple(c.current) == pytest.approx(design_fractions(hist, 16))
    assert c.current.overflow == pytest.approx(6 / 36)  # binades 0..5 overflow at 2^16


def test_init_scale_bell_keeps_two_binades():
    hist = {-12: 10, -11: 100, -10: 1000, -9: 100, -8: 10}
    c = choose_init_scale(hist, FP16, 2.0**16)
    assert c.k == 21  # -8 + 21 = 13
    assert as_tuple(c.chosen) == (0.0, 1.0, 0.0, 0.0)


def test_init_scale_below_one_for_huge_gradients():
    hist = {18: 1, 10: 9}
    c = choose_init_scale(hist, FP16, None)  # None: GradScaler's default 2^16
    assert c.k == -5
    assert c.current.k == 16
    assert as_tuple(c.current) == pytest.approx(design_fractions(hist, 16))
    assert c.current.overflow == 1.0
    assert as_tuple(c.chosen) == (0.0, 1.0, 0.0, 0.0)


def test_init_scale_other_format():
    fp8 = get_format("float8_e4m3fn")  # max 448 (binade 8), normal >= 2^-6, subnormal >= 2^-9
    hist = {-3: 10, 0: 10, -12: 5}
    c = choose_init_scale(hist, fp8, 1.0)
    assert c.k == 6  # 0 + 6 = 8 - 2
    # at 2^6: -12 -> -6 is normal, -3 -> 3, 0 -> 6
    assert as_tuple(c.chosen) == (0.0, 1.0, 0.0, 0.0)
    # at 2^0: -12 is below 2^-9: flushed
    assert c.current.flushed == pytest.approx(5 / 25)


def test_init_scale_without_data_keeps_the_current_scale():
    c = choose_init_scale({}, FP16, 1024.0)
    assert c.k == 10
    assert c.chosen.total == 0


# --------------------------------------------------------------------------------------------
# the other pure helpers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("eps", "fmt", "expected"),
    [
        (1e-8, "float16", "zero"),
        (2.0**-25, "float16", "zero"),  # exactly half the smallest subnormal: ties to even, 0
        (1.5 * 2.0**-25, "float16", "subnormal"),
        (1e-5, "float16", "subnormal"),
        (6.1e-5, "float16", "subnormal"),  # 1023 subnormal steps
        (6.1035e-5, "float16", "normal"),  # rounds up to 2^-14
        (1e-4, "float16", "normal"),
        (1e-8, "bfloat16", "normal"),
        (1e-45, "float32", "subnormal"),
        (1e-46, "float32", "zero"),
    ],
)
def test_eps_in_format(eps, fmt, expected):
    assert eps_in_format(eps, get_format(fmt)) == expected


def test_suggest_eps():
    assert suggest_eps(FP16) == 1e-4
    assert suggest_eps(get_format("float8_e4m3fn")) == 0.1  # smallest normal 2^-6 = 0.0156
    assert suggest_eps(get_format("bfloat16")) == 1e-37


@pytest.mark.parametrize(
    ("x", "nice"), [(6.88, 10.0), (0.3, 0.5), (2.0, 2.0), (1.01, 2.0), (150, 200.0), (501, 1000.0)]
)
def test_nice_ceil(x, nice):
    assert nice_ceil(x) == nice


def test_clip_value_is_a_rounded_up_percentile():
    assert clip_value([float(v) for v in range(1, 11)]) == 10.0  # 90th: the 9th of 10 -> 9 -> 10
    assert clip_value([0.31, 0.4, 0.35]) == 0.5
    assert clip_value([]) is None


@pytest.mark.parametrize(
    ("growth", "factor"), [(35.0, 0.01), (1e3, 0.01), (1.6, 0.1), (3.0, 0.01), (1.0, 0.1)]
)
def test_lr_factor(growth, factor):
    assert lr_factor(growth) == factor


# --------------------------------------------------------------------------------------------
# recommendations
# --------------------------------------------------------------------------------------------


def ffn_trace(sibling=(20000, 25000, 30000, 31000)) -> Trace:
    return trace_of(
        [
            layer("encoder.blocks.0.ffn.wo", fwd=sibling),
            layer("encoder.blocks.1.ffn.act", "GELU", fwd=[100, 200, 400, 800]),
            layer("encoder.blocks.1.ffn.wo", fwd=[1250, 5000, 20000, 60000]),
            layer("encoder.blocks.1", "Block", fwd=[1250, 5100, 20100, 60000]),
            layer("final_norm", "LayerNorm", fwd=[3, 3, 3, 3]),
            layer("lm_head", fwd=[9, 9, 9, 9]),
        ],
        4,
        scaler=True,
        scale=65536.0,
        skipped={3},
        fail=Failure(
            3, "forward", "encoder.blocks.1.ffn.wo", "output", stats(60000.0, posinf=5, neginf=2)
        ),
    )


def test_fp32_module_for_an_overflow_covers_siblings_and_the_region():
    t = advised(ffn_trace())
    assert t.diagnosis.kind == "overflow"
    r = t.recommendations[0]
    assert r.type == "fp32_module"
    assert r.module == "encoder.blocks.*.ffn.wo"  # the sibling peaks at 31000: 1.1 binades
    # the float32 output exceeds 65504: float32 through to the next normalisation
    assert r.value == ["encoder.blocks.*.ffn.wo", "final_norm"]
    assert 'run_in_float32(model, "encoder.blocks.*.ffn.wo")' in r.snippet
    assert 'run_in_float32(model, "final_norm", cast_back=torch.float16)' in r.snippet
    assert r.fix == ["fp32:encoder.blocks.*.ffn.wo..final_norm"]  # the snippet is this spec
    assert any("encoder.blocks.0.ffn.wo" in e for e in r.evidence)
    assert (r.verified, r.verification) == (False, "")
    assert r.data == {
        "modules": ["encoder.blocks.1.ffn.wo", "encoder.blocks.0.ffn.wo"],
        "region": ["encoder.blocks.*.ffn.wo", "final_norm"],
        "cast_to": "float16",
    }


def test_fp32_module_for_a_lone_instance():
    r = rec(advised(ffn_trace(sibling=(500, 800, 1200, 1500))), "fp32_module")
    assert r.module == "encoder.blocks.1.ffn.wo"
    assert r.value == ["encoder.blocks.1.ffn.wo", "final_norm"]
    assert any("not at risk" in e for e in r.evidence)


def test_clamp_for_an_inf_only_overflow():
    r = rec(advised(ffn_trace()), "clamp")
    assert r.value == FP16_MAX - 1000  # T5: finfo.max - 1000
    # the snippet is written from the --fix spec (one generator: the printed code is the change
    # --fix installs)
    assert r.fix == ["clamp:encoder.blocks.*.ffn.wo=64504"]
    assert "out.clamp(-64504, 64504)" in r.snippet
    assert r.data == {"where": "output", "bound": 64504.0}
    assert any("7 of 1024 values" in e for e in r.evidence)


def test_no_clamp_when_the_output_holds_nan():
    t = ffn_trace()
    t.first_failure.stats.nan = 3
    assert "clamp" not in [r.type for r in advised(t).recommendations]


def test_lower_lr_and_clip_for_an_optimizer_blow_up():
    t = advised(
        trace_of(
            [layer("head", fwd=[1.5, 260, 14000], params=[50, 1800, 60000])],
            3,
            norms=[6.9, 340, 25000],
            fail=Failure(2, "optimizer", "head", "head.weight", stats(60000.0, posinf=4, neginf=4)),
        )
    )
    assert t.diagnosis.kind == "lr_too_high"
    assert [r.type for r in t.recommendations] == ["lower_lr", "clip_grad_norm"]
    lr = t.recommendations[0]
    growth = (60000 / 50) ** 0.5  # 34.6x a step
    # 0.1 / (growth - 1) rounded down to a power of ten, but never below 0.01
    assert lr.value == max(0.01, 10.0 ** math.floor(math.log10(0.1 / (growth - 1))))
    assert f'group["lr"] *= {lr.value:g}' in lr.snippet
    clip = t.recommendations[1]
    assert clip.value == 10.0  # the one healthy norm (6.9, step 0) rounded up
    assert "scaler" not in clip.snippet


def test_clip_with_a_scaler_unscales_first():
    norms = [1.0, 1.1, 0.9, 1.0, 4.0, 20.0, 100.0, None]
    t = advised(
        trace_of(
            [layer("fc", fwd=[10] * 7 + [60000])],
            8,
            scaler=True,
            scale=1024.0,
            norms=norms,
            fail=Failure(7, "forward", "fc", "output", stats(60000.0, posinf=1)),
        )
    )
    assert t.diagnosis.kind == "exploding_gradient"
    clip = t.recommendations[0]
    assert clip.type == "clip_grad_norm"
    assert clip.value == 2.0  # healthy norms before the growth (steps 0-2): 1.0, 1.1, 0.9
    assert clip.fix == ["clip=2"]
    lines = clip.snippet.splitlines()
    assert lines.index("scaler.unscale_(optimizer)  # before scaler.step(optimizer)") < next(
        i for i, ln in enumerate(lines) if ln.startswith("torch.nn.utils.clip_grad_norm_(")
        and ln.endswith("max_norm=2)"))


def test_eps_for_an_optimizer_nan_with_fp16_weights():
    t = advised(
        trace_of(
            [layer("head", fwd=[1, 1, 1], params=[0.5, 0.5, 0.5], pg=stats(1e-6, underflow=900))],
            3,
            fail=Failure(2, "optimizer", "head", "head.weight", stats(0.5, nan=16)),
            optimizers=[],  # its type unknown (a report from before trace.optimizers)
        )
    )
    r = rec(t, "eps")
    assert r.value == 1e-4
    assert 'group["eps"] = 0.0001' in r.snippet
    assert any("Adam's default eps 1e-08 is zero in float16" in e for e in r.evidence)


def test_eps_for_a_norm_that_divides_by_zero():
    t = advised(
        trace_of(
            [layer("proj", fwd=[1e-3, 1e-3]), layer("enc.norm", "RMSNorm", fwd=[1, 1])],
            2,
            fail=Failure(1, "forward", "enc.norm", "output", stats(0.0, posinf=16)),
        )
    )
    assert t.diagnosis.kind == "underflow"
    r = t.recommendations[0]
    assert (r.type, r.module, r.value) == ("eps", "enc.norm", 1e-4)
    assert r.fix == ["eps:enc.norm=0.0001"]
    assert 'fnmatch.fnmatchcase(name, "enc.norm")' in r.snippet
    assert "setattr(module, attr, 0.0001)" in r.snippet
    assert 'for attr in ("eps", "variance_epsilon", "epsilon"):' in r.snippet


def test_clamp_and_fp32_probabilities_for_log_zero_in_the_loss():
    t = trace_of(
        [
            layer("fc", fwd=[3, 4, 5]),
            layer("softmax", "Softmax", fwd=[1, 1, 1], zero=12),
            layer("criterion", "NLLFromProbs", fwd=[2.1, 0.5], dtype="float32"),
        ],
        3,
        scaler=True,
        scale=65536.0,
        fail=Failure(2, "forward", "criterion", "output", stats(0.0, dtype="float32", posinf=1)),
    )
    t = advised(t)
    assert t.diagnosis.rule == "loss-nan-op"
    clamp, fp32 = t.recommendations[:2]
    assert (clamp.type, clamp.value) == ("clamp", 2.0**-14)  # float16's smallest normal
    assert "criterion.register_forward_pre_hook" in clamp.snippet
    assert clamp.data == {"where": "input", "min": 2.0**-14}  # a floor on its input, not ±
    assert any(f"{-math.log(2.0**-14):.3g}" in e for e in clamp.evidence)
    assert (fp32.type, fp32.module) == ("fp32_module", "softmax")


def test_fix_data_names_step_and_samples():
    t = advised(
        trace_of(
            [layer("net.0", fwd=[1, 1])],
            2,
            fail=Failure(
                1,
                "data",
                "net.0",
                "input[0]",
                stats(2.0, numel=64, nan=3),
                bad_samples={"input[0]": [4, 9]},
            ),
        )
    )
    r = t.recommendations[0]
    assert r.type == "fix_data"
    assert r.value == {"step": 1, "samples": {"input[0]": [4, 9]}}
    assert "# nanhunt saw step 1: input[0]: [4, 9]" in r.snippet


def test_normalize_input_after_a_range_jump():
    t = advised(
        trace_of(
            [
                layer("input_proj", fwd=[5, 6, 5, 66], params=[3, 3, 3, 3]),
                layer("head", fwd=[1] * 4),
            ],
            4,
        )
    )
    r = rec(t, "normalize_input")
    assert r.value == {"module": "input_proj", "step": 3, "jump": round(66 / 5, 3)}


def test_init_scale_for_a_half_model_without_scaler():
    pg = stats(1e-5, underflow=500)
    t = trace_of(
        [layer("fc", fwd=[1, 1], pg=pg)],
        2,
        grad_hist={"float16": {-20: 60, -18: 30, -10: 10}},
    )
    t = advised(t)
    assert t.warnings[0].rule == "gradient-underflow"
    r = rec(t, "init_scale")
    assert r.value == 2.0**23  # top binade -10 + 23 = 13
    assert "model.float()" in r.snippet  # GradScaler cannot unscale float16 gradients
    assert 'torch.amp.GradScaler("cpu", init_scale=2.0**23, growth_interval=2000)' in r.snippet
    assert any("without a loss scale: 0% overflow, 90% subnormal" in e for e in r.evidence)


def test_init_scale_when_every_gradient_flushed():
    t = trace_of([layer("fc", fwd=[0.1] * 3, pg=stats(0.0, zero=1024))], 3, norms=[0.0] * 3)
    t.grad_hist = {"float16": {}}
    r = rec(advised(t), "init_scale")
    assert r.value == 2.0**16  # nothing to size it from: GradScaler's default
    assert "model.float()" in r.snippet
    assert any("no non-zero gradient was recorded" in e for e in r.evidence)


def test_init_scale_when_the_scale_is_too_low():
    t = trace_of(
        [layer("fc", fwd=[1, 1])],
        2,
        scaler=True,
        scale=1.0,
        grad_hist={"float16": {-30: 50, -20: 50}},
    )
    r = rec(advised(t), "init_scale")
    assert r.value == 2.0**33
    over, normal, sub, flushed = design_fractions({-30: 50, -20: 50}, 0)
    assert (over, normal, sub, flushed) == (0.0, 0.0, 0.5, 0.5)
    assert any(
        "at 2^0 (the run's init_scale): 0% overflow, 50% subnormal, 50% flush" in e
        for e in r.evidence
    )


def test_growth_interval_grows_when_growth_keeps_backing_off():
    events = []
    for g in (100, 300, 500):
        events += [
            ScalerEvent(g, "growth", 1024.0, 2048.0),
            ScalerEvent(g + 1, "backoff", 2048.0, 1024.0),
        ]
    t = trace_of(
        [layer("fc", fwd=[1] * 600)],
        600,
        scaler=True,
        scale=1.0,
        scaler_events=events,
        grad_hist={"float16": {-30: 50, -20: 50}},
    )
    r = rec(advised(t), "init_scale")
    assert "growth_interval=500" in r.snippet  # twice the 200-step spacing, rounded up nicely


def test_healthy_run_gets_no_recommendations():
    scales = [65536.0, 32768.0, 16384.0] + [8192.0] * 7
    t = trace_of(
        [layer("net.0", fwd=[5] * 10, bwd=[100] * 10), layer("head", fwd=[2] * 10, bwd=[800] * 10)],
        10,
        scaler=True,
        skipped={0, 1, 2},
        norms=[math.nan] * 3 + [1.0] * 7,
        scaler_events=[ScalerEvent(i, "backoff", scales[i], scales[i] / 2) for i in range(3)],
        grad_hist={"float16": dict.fromkeys(range(-22, -8), 100)},
    )
    for s, scale in zip(t.steps, scales):
        s.scale = scale
    t = advised(t)
    assert t.diagnosis is None
    # three calibration skips: one warning and the init_scale the scale settled at (8192)
    assert [w.rule for w in t.warnings] == ["skip-streak"]
    (rec,) = t.recommendations
    assert (rec.type, rec.value) == ("init_scale", 8192.0)


def test_advise_runs_diagnose_when_needed_and_orders_by_relevance():
    t = ffn_trace()
    advise(t)
    assert t.diagnosis is not None
    types = [r.type for r in t.recommendations]
    assert types[:2] == ["fp32_module", "clamp"]
    assert len({(r.type, r.module) for r in t.recommendations}) == len(t.recommendations)


@pytest.mark.parametrize(
    "make",
    [ffn_trace, lambda: ffn_trace(sibling=(1, 1, 1, 1))],
)
def test_every_snippet_is_valid_python(make):
    t = advised(make())
    assert t.recommendations
    for r in t.recommendations:
        compile(r.snippet, f"<{r.type}>", "exec")
        assert r.evidence
        assert (r.verified, r.verification) == (False, "")
    Trace.from_json(t.to_json())  # the values serialise


def test_fp32_helper_runs_the_module_in_float32_under_autocast():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    seen = {}
    for name, m in model.named_children():
        m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, out.dtype))
    scope = {"model": model}
    exec(
        FP32_HELPER.format(device="cpu")
        + '\nrun_in_float32(model, "0")\nrun_in_float32(model, "1", cast_back=torch.float16)',
        scope,
    )
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.randn(3, 4))
    assert seen == {"0": torch.float32, "1": torch.float16, "2": torch.float16}
    assert out.dtype == torch.float16


def test_clamp_template_for_an_invalid_op():
    t = trace_of(
        [layer("proj", fwd=[2, 2, 2, 2]), layer("attn", "Attention", fwd=[1.5, 1.5, 1.5])],
        4,
        fail=Failure(3, "forward", "attn", "output", stats(1.2, nan=10), op="aten.log.default"),
    )
    t = advised(t)
    assert t.diagnosis.kind == "nan_op"
    r = rec(t, "clamp")
    assert r.data == {"where": "op_input", "op": "log", "min": 2.0**-14}
    assert "y = torch.log(x.clamp_min(6.103515625e-05))" in r.snippet
    assert rec(t, "fp32_module").module == "attn"  # it ran in float16


def test_a_nan_collapse_gets_no_float32_or_clipping_advice():
    scales = [65536.0 / 2**i for i in range(18)]
    t = trace_of(
        [layer("dist", "Distance", fwd=[1] * 18, bwd=[0.5] * 18)],
        18,
        scaler=True,
        skipped=set(range(18)),
        scaler_events=[ScalerEvent(i, "backoff", s, s / 2) for i, s in enumerate(scales)],
        fail=Failure(
            0,
            "loss_scaling",
            "dist",
            "grad_input[0]",
            stats(0.0, nan=4),
            op="aten::div",  # sqrt's derivative divides by 2 * sqrt(x)
            source="train.py:5",
            source_line="        return ((a - b) ** 2).sum(-1).sqrt()",
        ),
    )
    for s, scale in zip(t.steps, scales):
        s.scale = scale
    t = advised(t)
    # the op is the cause (phase backward), the collapse its evidence
    assert (t.diagnosis.kind, t.diagnosis.phase) == ("nan_op", "backward")
    assert [r.type for r in t.recommendations] == ["clamp"]
    # the user's own line with the floor in it (written from the floor:... spec)
    assert t.recommendations[0].snippet.endswith(
        "return ((a - b) ** 2).sum(-1).clamp_min(6.103515625e-05).sqrt()")



def gpt_trace(blocks: int, culprit: int, sibling_peak: float = 40000.0) -> Trace:
    """nanoGPT's module order: each block's ln_1, attn, ln_2, mlp (c_fc, gelu, c_proj), then
    ln_f after the last block; the culprit block's mlp.c_fc overflows, the others' peak at
    ``sibling_peak``."""
    layers = [layer("transformer.wte", "Embedding", fwd=[1, 1, 1, 1])]
    for b in range(blocks):
        h = f"transformer.h.{b}"
        fc = [1250, 5000, 20000, 70000] if b == culprit else [sibling_peak] * 4
        layers += [
            layer(f"{h}.ln_1", "LayerNorm", fwd=[3, 3, 3, 3]),
            layer(f"{h}.attn.c_attn", fwd=[9, 9, 9, 9]),
            layer(f"{h}.attn", "CausalSelfAttention", fwd=[8, 8, 8, 8]),
            layer(f"{h}.ln_2", "LayerNorm", fwd=[3, 3, 3, 3]),
            layer(f"{h}.mlp.c_fc", fwd=fc),
            layer(f"{h}.mlp.gelu", "GELU", fwd=fc),
            layer(f"{h}.mlp.c_proj", fwd=[700, 700, 700, 7000]),
            layer(f"{h}.mlp", "MLP", fwd=[700, 700, 700, 7000]),
            layer(h, "Block", fwd=[710, 710, 710, 7010]),
        ]
    layers += [layer("transformer.ln_f", "LayerNorm", fwd=[3, 3, 3, 3]),
               layer("lm_head", fwd=[9, 9, 9, 9])]
    return trace_of(layers, 4, scaler=True, scale=65536.0, skipped={3}, fail=Failure(
        3, "forward", f"transformer.h.{culprit}.mlp.c_fc", "output",
        stats(70000.0, posinf=5, neginf=2)))


@pytest.mark.parametrize(("blocks", "culprit", "ends"), [
    (2, 0, ["transformer.h.1.ln_1", "transformer.ln_f"]),
    (2, 1, ["transformer.h.1.ln_1", "transformer.ln_f"]),
    (3, 0, ["transformer.h.*.ln_1", "transformer.ln_f"]),
])
def test_an_fp32_region_of_siblings_ends_at_each_instances_next_normalisation(
        blocks, culprit, ends):
    """Every instance the pattern runs in float32 needs its own end: the next block's ln_1,
    and for the last block the model's ln_f."""
    from nanhunt.analyse.remedies import attach_fixes
    from nanhunt.fixspec import parse_fix

    t = advised(gpt_trace(blocks, culprit))
    r = rec(t, "fp32_module")
    assert r.module == "transformer.h.*.mlp.c_fc"
    region = r.data["region"]
    assert region[0] == "transformer.h.*.mlp.c_fc"
    assert region[-len(ends):] == ends
    assert "transformer.h.*.mlp.c_proj" in region
    for end in ends:
        assert f'run_in_float32(model, "{end}", cast_back=torch.float16)' in r.snippet
    attach_fixes(t)
    spec = parse_fix(r.fix[0])
    assert list(spec.patterns[len(spec.starts):]) == ends  # the installed fix ends there too


def _scaler_trace(settings: dict | None) -> Trace:
    t = trace_of([layer("fc", fwd=[1, 1])], 2, scaler=True, scale=1.0,
                 grad_hist={"float16": {-30: 50, -20: 50}})
    t.run.scaler_settings = settings
    return t


def test_init_scale_keeps_the_scripts_own_growth_interval():
    """The script built GradScaler(growth_interval=1e9): the card says so, and the fix changes
    only what it recommends (the init_scale)."""
    from nanhunt.analyse.remedies import attach_fixes

    t = advised(_scaler_trace({"init_scale": 1.0, "growth_factor": 2.0,
                               "backoff_factor": 0.5, "growth_interval": 1000000000}))
    r = rec(t, "init_scale")
    assert r.data["growth_interval"] == 1000000000
    assert not any("(the default)" in e for e in r.evidence)
    assert any("growth_interval=1000000000 (the script's own)" in e for e in r.evidence)
    assert "keep your other arguments" in r.snippet  # growth_interval among them
    attach_fixes(t)
    assert r.fix == ["init-scale=8589934592"]  # 2^33; the interval is the script's already


def test_init_scale_with_unknown_settings_still_names_the_default():
    r = rec(advised(_scaler_trace(None)), "init_scale")
    assert any("growth_interval=2000 (the default)" in e for e in r.evidence)


def test_a_wider_rung_that_verified_is_the_headline():
    """Re-run verification tried init_scale 2^25 (failed), then 2^21 (verified): the card's
    value, data and snippet are 2^21's."""
    from nanhunt.analyse.remedies import attach_fixes, set_fix
    from nanhunt.fixspec import parse_fix
    from nanhunt.report import render_terminal

    t = advised(_scaler_trace(None))
    attach_fixes(t)
    r = rec(t, "init_scale")
    set_fix(r, t, [parse_fix(f"init-scale={2.0 ** 21}")])
    assert (r.value, r.data["k"]) == (2.0**21, 21)
    assert "init_scale=2097152)" in r.snippet  # 2^21
    out = io.StringIO()
    render_terminal(t, Console(file=out, width=100, color_system=None))
    head = next(line for line in out.getvalue().splitlines() if "init_scale ·" in line)
    assert "2^21" in head and "2^33" not in head


def test_fp32_master_weights_is_installable():
    from nanhunt.analyse.remedies import attach_fixes
    from nanhunt.trace import Recommendation

    t = trace_of([layer("fc", fwd=[1, 1])], 2)
    t.recommendations = [Recommendation(type="fp32_master_weights", value="Adam",
                                        snippet="model = model.float()")]
    attach_fixes(t)
    r = t.recommendations[0]
    assert r.fix == ["fp32-master"] and not r.code_change
    assert "step_with_fp32_master(optimizer, masters)" in r.snippet
