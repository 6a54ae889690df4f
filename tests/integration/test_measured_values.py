"""The values the experiment ladder computes from a run, applied to the script: clipping at the
measured gradient norm and GradScaler's init_scale from the gradients' exponents, each installed
around the script in this process and judged by what the script itself prints (its losses and
its scale), against the script's own unfixed output.

The eps a rule computes (the smallest power of ten normal in float16) is applied the same way.
The traces they are computed from are the shared ``--verify 0`` runs of
tests/integration/test_training_failures.py (the same command lines: no extra CLI run).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_fixes import run_script

from nanhunt.experiment.ladder import BLOWUP, failure_step, measured_clip, measured_init_scale
from nanhunt.fixspec import number
from nanhunt.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"
RNN = SCRIPTS / "explode_elman_rnn.py"
SUM = SCRIPTS / "skips_sum_reduction.py"


def prefetch(cli) -> dict:
    # the same command lines as test_training_failures.py's "explode-rnn" and "skips-sum" and
    # test_loop_causes.py's "adam_transformer" and "rmsnorm"
    return {"rnn": cli.submit("diagnose", "--quiet", RNN),
            "sum": cli.submit("diagnose", "--quiet", SUM),
            "adam": cli.submit("diagnose", "--quiet", SCRIPTS / "adam_eps_half_transformer.py"),
            "rmsnorm": cli.submit("diagnose", "--quiet",
                                  SCRIPTS / "rmsnorm_eps_half_transformer.py")}


@pytest.fixture(scope="module")
def runs(cli) -> dict:
    return prefetch(cli)


def _field(lines: list[str], name: str) -> list[float]:
    out = []
    for line in lines:
        words = line.split()
        if line.startswith("step ") and name in words:
            out.append(float(words[words.index(name) + 1]))
    return out


def _diverged(losses: list[float]) -> bool:
    return any(not math.isfinite(v) for v in losses) or max(losses) > BLOWUP * losses[0]


def test_clipping_at_the_measured_norm_trains_the_exploding_rnn(runs):
    res = runs["rnn"].result()
    assert res.code == 1, res.stderr
    trace = Trace.from_dict(res.report)
    step = failure_step(trace)
    clip = measured_clip(trace, step)
    before = [s.grad_norm for s in trace.steps if s.index < step and s.grad_norm is not None
              and math.isfinite(s.grad_norm)]
    # the low end of the norms before the failure, rounded up within one 1-2-5 step
    assert min(before) <= clip <= 2.5 * min(before) < max(before)
    unfixed = _field(res.stdout.splitlines(), "loss")
    assert _diverged(unfixed), unfixed  # the script's own output without the fix
    fixed = _field(run_script(RNN, fixes=[f"clip={number(clip)}"]), "loss")
    # nanhunt stopped the unfixed run at its failure; the fixed one runs to the script's end
    assert len(fixed) >= len(unfixed) and not _diverged(fixed), (clip, fixed)


def test_the_init_scale_from_the_gradients_exponents_removes_the_calibration_skips(runs):
    res = runs["sum"].result()
    trace = Trace.from_dict(res.report)
    scale = measured_init_scale(trace)
    assert scale is not None and math.log2(scale).is_integer() and scale < 2.0 ** 16
    steps = 4  # growth_interval is 4: the first 4 steps show the calibration
    unfixed = _field(res.stdout.splitlines(), "scale")[:steps]
    fixed_lines = run_script(SUM, ["--steps", str(steps)], fixes=[f"init-scale={number(scale)}"])
    fixed = _field(fixed_lines, "scale")

    def skips(scales: list[float], start: float) -> int:
        # GradScaler halves the scale after a skipped step (printed after update())
        return sum(b < a for a, b in zip([start, *scales], scales))

    assert skips(unfixed[:4], 2.0 ** 16) >= 3  # the default scale overflows, again and again
    assert skips(fixed[:4], scale) == 0 and fixed[0] == scale
    losses = _field(fixed_lines, "loss")
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize(("key", "script"), [("adam", "adam_eps_half_transformer.py"),
                                             ("rmsnorm", "rmsnorm_eps_half_transformer.py")])
def test_the_computed_eps_trains(runs, key, script):
    res = runs[key].result()
    rec = next(r for r in res.report["recommendations"] if r["type"] == "eps")
    assert rec["value"] == 1e-4 and rec["fix"], rec  # float16's smallest normal is 6.1e-5
    # the script without the fix: its second step's loss is NaN (nanhunt stopped the CLI run
    # at the failure, in step 0's optimizer step, before the script printed it)
    unfixed = _field(run_script(SCRIPTS / script, ["--steps", "2"]), "loss")
    assert not math.isfinite(unfixed[1]), unfixed
    fixed = _field(run_script(SCRIPTS / script, fixes=rec["fix"]), "loss")
    assert len(fixed) == 4 and all(math.isfinite(v) for v in fixed), (rec["fix"], fixed)
