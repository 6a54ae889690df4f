"""`nanhunt diagnose`, as a user runs it, on failures whose cause is outside the failing module's
arithmetic: GradScaler misuse in the loop, an optimizer eps that is 0 in float16, a norm's eps
that is 0 in float16, and an unnormalised batch. Each class has scripts in two architectures
(tests/scripts/) and healthy controls (the same script with the fix) that must stay quiet.

References that do not come from nanhunt: the scripts' own output under plain ``python`` (the
failure and its float32/fixed control), the script text (which line makes the call), a small
TorchDispatchMode of our own that finds the first op whose output is non-finite, and
``torch.tensor(eps, dtype=torch.float16)``.
"""

from __future__ import annotations

import json
import math
import re
import runpy
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

#: key -> script and its arguments; every run shares the session's pool (conftest)
RUNS = {
    "outside_mlp": ["scaler_step_outside_mlp.py"],
    "outside_cnn": ["scaler_step_outside_cnn.py"],
    "double_mlp": ["scaler_step_outside_mlp.py", "--double", "--steps", "2"],
    "leftover_mlp": ["scaler_step_outside_mlp.py", "--leftover", "--steps", "3"],
    "leftover_cnn": ["scaler_step_outside_cnn.py", "--leftover", "--steps", "3"],
    "clip_gru": ["scaler_clip_before_unscale_gru.py", "--steps", "2"],
    "zero_grad_mlp": ["scaler_zero_grad_after_unscale.py", "--arch", "mlp", "--steps", "4"],
    "zero_grad_cnn": ["scaler_zero_grad_after_unscale.py", "--arch", "cnn", "--steps", "4"],
    "clip_mlp": ["scaler_clip_before_unscale_mlp.py", "--steps", "2"],
    "adam_transformer": ["adam_eps_half_transformer.py"],
    "adamw_cnn": ["adam_eps_half_cnn.py"],
    "rmsprop_cnn": ["adam_eps_half_cnn.py", "--optim", "rmsprop"],
    "rmsnorm": ["rmsnorm_eps_half_transformer.py"],
    "layernorm": ["layernorm_eps_half_cnn.py"],
    "pixels": ["raw_pixels_cnn.py"],
    "tabular": ["tabular_thousands_mlp.py"],
    "logtarget_mlp": ["log_target_zero.py", "--arch", "mlp", "--steps", "5"],
    "logtarget_conv1d": ["log_target_zero.py", "--arch", "conv1d", "--steps", "5"],
    # healthy controls: the same scripts with the fix (correct scaler order with clipping
    # after unscale_, fp32 master weights, a nonzero eps, normalised inputs), and legitimately
    # large inputs that fit
    # (24 steps: its summed loss costs 7 calibration skips and one more, 40% of 20 steps)
    "ok_outside_mlp": ["scaler_step_outside_mlp.py", "--fixed", "--steps", "24"],
    "ok_adam_master": ["adam_eps_half_cnn.py", "--fixed", "master", "--steps", "3"],
    "ok_adam_eps": ["adam_eps_half_transformer.py", "--fixed", "eps", "--steps", "3"],
    "ok_rmsnorm": ["rmsnorm_eps_half_transformer.py", "--fixed", "eps", "--steps", "3"],
    "ok_pixels": ["raw_pixels_cnn.py", "--normalize", "--steps", "3"],
    "ok_pixels_8bit": ["healthy_raw_pixels_8bit.py", "--steps", "4"],
    "ok_zero_grad": ["scaler_zero_grad_after_unscale.py", "--fixed", "--steps", "4"],
    "ok_logtarget": ["log_target_zero.py", "--arch", "conv1d", "--fixed", "--steps", "5"],
}

#: the scripts under plain python (no nanhunt): the failures and their float32/fixed controls
PLAIN = {
    "outside_mlp": ["scaler_step_outside_mlp.py", "--steps", "2"],
    "outside_mlp_fixed": ["scaler_step_outside_mlp.py", "--fixed", "--steps", "2"],
    "outside_cnn": ["scaler_step_outside_cnn.py", "--steps", "2"],
    "outside_cnn_fixed": ["scaler_step_outside_cnn.py", "--fixed", "--steps", "2"],
    "leftover_mlp": ["scaler_step_outside_mlp.py", "--leftover", "--steps", "3"],
    "leftover_cnn": ["scaler_step_outside_cnn.py", "--leftover", "--steps", "3"],
    "layernorm_fixed": ["layernorm_eps_half_cnn.py", "--fixed", "eps", "--steps", "2"],
    "pixels_fp32": ["raw_pixels_cnn.py", "--fp32", "--steps", "2"],
    "tabular_fp32": ["tabular_thousands_mlp.py", "--fp32", "--steps", "2"],
    "logtarget_mlp": ["log_target_zero.py", "--arch", "mlp", "--steps", "5"],
    "logtarget_conv1d": ["log_target_zero.py", "--arch", "conv1d", "--steps", "5"],
    "zero_grad_mlp": ["scaler_zero_grad_after_unscale.py", "--arch", "mlp", "--steps", "4"],
    "zero_grad_cnn": ["scaler_zero_grad_after_unscale.py", "--arch", "cnn", "--steps", "4"],
    "zero_grad_mlp_lr0": ["scaler_zero_grad_after_unscale.py", "--arch", "mlp", "--steps", "4",
                          "--lr", "0"],
    "zero_grad_cnn_lr0": ["scaler_zero_grad_after_unscale.py", "--arch", "cnn", "--steps", "4",
                          "--lr", "0"],
}


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, out: Path) -> None:
        self.code, self.stdout, self.stderr = proc.returncode, proc.stdout, proc.stderr
        self.report = json.loads((out / "report.json").read_text())

    @property
    def diagnosis(self) -> dict:
        return self.report["diagnosis"]

    def rec(self, type_: str) -> dict:
        return next(r for r in self.report["recommendations"] if r["type"] == type_)


def _submit(cli) -> tuple[dict, dict]:
    """Every CLI and plain-python run of this module, in the session's shared pool (each made
    once per session: tests/integration/conftest.py); the futures of their results."""
    # --verify 0 (the shared helper's default): re-run verification is tested in
    # test_verify_rerun.py
    nanhunt = {key: cli.submit("diagnose", "--quiet", SCRIPTS / script, *args)
               for key, (script, *args) in RUNS.items()}
    plain = {key: cli.python(SCRIPTS / script, *args, timeout=300)
             for key, (script, *args) in PLAIN.items()}
    return nanhunt, plain


prefetch = _submit  # started when collection ends (tests/integration/conftest.py)


@pytest.fixture(scope="module")
def runs(cli) -> dict[str, Run]:
    results = {key: fut.result() for key, fut in _submit(cli)[0].items()}
    return {key: Run(r, r.out) for key, r in results.items()}


@pytest.fixture(scope="module")
def plain(cli) -> dict[str, list[float]]:
    """Each PLAIN script's own losses under plain python (no nanhunt): the reference runs."""

    def losses(proc) -> list[float]:
        assert proc.returncode == 0, proc.stderr
        return [float(m) for m in re.findall(r"loss (\S+)", proc.stdout)]

    return {key: losses(fut.result()) for key, fut in _submit(cli)[1].items()}


def _line_of(script: str, text: str) -> int:
    """1-based number of the first code line (indented: not the docstring) of the script that
    starts with ``text``."""
    lines = (SCRIPTS / script).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1)
                if line.startswith("    ") and line.strip().startswith(text))


class FirstNonFinite(TorchDispatchMode):
    """Our own reference locator: the first aten op whose floating output is not finite."""

    def __init__(self) -> None:
        super().__init__()
        self.first: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.first is None and any(
                isinstance(t, torch.Tensor) and t.is_floating_point()
                and not bool(torch.isfinite(t).all()) for t in tree_leaves(out)):
            self.first = str(func.overloadpacket)
        return out


# ----------------------------------------------------------------------------- GradScaler misuse


@pytest.mark.parametrize(("key", "script"), [("outside_mlp", "scaler_step_outside_mlp.py"),
                                             ("outside_cnn", "scaler_step_outside_cnn.py")])
def test_optimizer_step_outside_scaler_step(runs, plain, key, script):
    losses = plain[key]
    assert math.isfinite(losses[0]) and math.isnan(losses[1])  # the failure, without nanhunt
    assert all(math.isfinite(v) for v in plain[key + "_fixed"])
    r = runs[key]
    assert r.code == 1
    d = r.diagnosis
    assert (d["rule"], d["kind"], d["phase"]) == ("scaler-misuse", "loss_scale", "loss_scaling")
    assert d["data"]["misuse"] == "optimizer_outside_scaler_step"
    lines = (SCRIPTS / script).read_text().splitlines()
    # the script's own optimizer.step() in the bug's branch (the one after "else:")
    line = next(i for i in range(1, len(lines)) if lines[i - 1].strip() == "else:"
                and lines[i].strip() == "optimizer.step()") + 1
    assert d["data"]["source"].endswith(f"{script}:{line}")
    assert d["data"]["source_line"] == "optimizer.step()"
    assert "learning rate" not in json.dumps([d, r.report["warnings"]]).lower()
    assert all(rec["type"] != "lower_lr" for rec in r.report["recommendations"])
    snippet = r.rec("scaler_usage")["snippet"]
    assert snippet.index("scaler.unscale_") < snippet.index("clip_grad_norm_") < \
        snippet.index("scaler.step(optimizer)") < snippet.index("scaler.update()")
    # honest timeline: step 0's inf gradients were applied, so it was not a skipped step
    assert r.report["steps"][0]["skipped"] is False
    assert r.report["loop_calls"][0]["found_inf"] is True


def test_optimizer_stepped_again_after_scaler_step(runs):
    r = runs["double_mlp"]
    assert r.code == 1
    d = r.diagnosis
    assert (d["rule"], d["kind"], d["data"]["misuse"]) == ("scaler-misuse", "loss_scale",
                                                           "optimizer_stepped_twice")
    script = "scaler_step_outside_mlp.py"
    lines = (SCRIPTS / script).read_text().splitlines()
    # the optimizer.step() right after scaler.step(optimizer) in the --double branch
    line = next(i for i in range(1, len(lines)) if lines[i - 1].strip() == "scaler.step("
                "optimizer)" and lines[i].strip() == "optimizer.step()") + 1
    assert d["data"]["source"].endswith(f"{script}:{line}")
    assert "remove the optimizer.step() call" in d["message"]
    assert "learning rate" not in json.dumps([d, r.report["warnings"]]).lower()


@pytest.mark.parametrize(("key", "script"), [("leftover_mlp", "scaler_step_outside_mlp.py"),
                                           ("leftover_cnn", "scaler_step_outside_cnn.py")])
def test_optimizer_step_left_after_scaler_update(runs, plain, key, script):
    # reference: under plain python the loss is finite at step 0 and NaN from step 1 on (the
    # leftover call applied step 0's skipped, inf gradients)
    losses = plain[key]
    assert math.isfinite(losses[0]) and all(math.isnan(v) for v in losses[1:])
    r = runs[key]
    assert r.code == 1
    d = r.diagnosis
    assert (d["rule"], d["kind"], d["phase"], d["step"], d["data"]["misuse"]) == (
        "scaler-misuse", "loss_scale", "loss_scaling", 0, "optimizer_stepped_twice")
    lines = (SCRIPTS / script).read_text().splitlines()
    # the optimizer.step() after scaler.update() in the --leftover branch
    line = next(i for i in range(1, len(lines)) if lines[i - 1].strip() == "if args.leftover:"
                and lines[i].strip() == "optimizer.step()") + 1
    assert d["data"]["source"].endswith(f"{script}:{line}")
    assert any("GradScaler found inf/NaN" in e for e in d["evidence"])
    assert any("not a learning rate problem" in e for e in d["evidence"])
    assert all(w["kind"] != "lr_too_high" for w in r.report["warnings"])
    assert all(rec["type"] != "lower_lr" for rec in r.report["recommendations"])
    # one step per iteration: the extra call is not a step of its own
    assert [s["index"] for s in r.report["steps"]] == list(range(len(r.report["steps"])))
    assert len(r.report["steps"]) <= 3


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_zero_grad_between_unscale_and_step(runs, plain, arch):
    # reference: the losses equal those of the same script with lr=0, step for step: no update
    # was ever applied, and nothing went non-finite
    assert plain[f"zero_grad_{arch}"] == plain[f"zero_grad_{arch}_lr0"]
    r = runs[f"zero_grad_{arch}"]
    assert r.code == 1
    d = r.diagnosis
    assert (d["rule"], d["kind"], d["phase"], d["data"]["misuse"]) == (
        "scaler-misuse", "loss_scale", "loss_scaling", "zero_grad_after_unscale")
    script = "scaler_zero_grad_after_unscale.py"
    # the zero_grad() under "if not args.fixed:" (the bug's branch)
    lines = (SCRIPTS / script).read_text().splitlines()
    line = next(i for i in range(1, len(lines)) if lines[i - 1].strip() == "if not args.fixed:"
                and lines[i].strip() == "optimizer.zero_grad()") + 1
    assert d["data"]["source"].endswith(f"{script}:{line}")
    assert r.report["first_failure"] is None
    assert r.rec("scaler_usage")


@pytest.mark.parametrize(("key", "script", "call"), [
    ("clip_gru", "scaler_clip_before_unscale_gru.py", "torch.nn.utils.clip_grad_norm_("),
    ("clip_mlp", "scaler_clip_before_unscale_mlp.py", "torch.nn.utils.clip_grad_norm_("),
])
def test_clipping_before_unscale(runs, key, script, call):
    r = runs[key]
    assert r.code == 1
    assert r.report["first_failure"] is None  # nothing went non-finite: the order is the bug
    d = r.diagnosis
    assert (d["rule"], d["kind"], d["data"]["misuse"]) == ("scaler-misuse", "loss_scale",
                                                           "clip_on_scaled_grads")
    assert d["data"]["source"].endswith(f"{script}:{_line_of(script, call)}")
    assert r.rec("scaler_usage")["value"] == "clip_on_scaled_grads"


# ----------------------------------------------------------------------------- optimizer eps


def test_adam_eps_is_zero_in_float16():
    # the arithmetic the diagnosis rests on, from torch itself
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0
    assert torch.tensor(1e-4, dtype=torch.float16).item() > 0.0


def _reference_optimizer_op(optim: str) -> str | None:
    """Our locator on the first AdamW/RMSprop step of the .half() CNN, built from the script's
    own classes: which op makes the first non-finite value."""
    ns = runpy.run_path(str(SCRIPTS / "adam_eps_half_cnn.py"), run_name="reference")
    torch.manual_seed(0)
    model = ns["Net"]().half()
    cls = torch.optim.AdamW if optim == "adamw" else torch.optim.RMSprop
    optimizer = cls(model.parameters(), lr=1e-3, eps=1e-8)
    images, labels = torch.randn(64, 3, 16, 16), torch.randint(0, 10, (64,))
    loss = torch.nn.functional.cross_entropy(model(images[:16].half()).float(), labels[:16])
    loss.backward()
    with FirstNonFinite() as mode:
        optimizer.step()
    return mode.first


@pytest.mark.parametrize(("key", "optim", "cls"), [("adam_transformer", None, "Adam"),
                                                   ("adamw_cnn", "adamw", "AdamW"),
                                                   ("rmsprop_cnn", "rmsprop", "RMSprop")])
def test_optimizer_eps_in_half_precision(runs, key, optim, cls):
    r = runs[key]
    assert r.code == 1
    f, d = r.report["first_failure"], r.diagnosis
    assert (f["phase"], f["step"]) == ("optimizer", 0)
    assert (d["rule"], d["kind"], d["phase"]) == ("optimizer-eps", "underflow", "optimizer")
    assert f"{cls}'s eps=1e-08" in d["message"]
    assert r.report["optimizers"][0]["eps"] == 1e-8
    assert r.report["optimizers"][0]["param_dtypes"] == ["float16"]
    assert "learning rate" not in d["message"]
    if optim is not None:
        ref = _reference_optimizer_op(optim)
        assert ref is not None and f["op"].startswith(ref)
    assert f["source"].startswith("torch/optim/")
    eps = r.rec("eps")
    assert eps["value"] == 1e-4 and eps["data"]["where"] == "optimizer"
    # the replayed step with eps=1e-4 is finite: a replay check, not "verified" (no re-run here)
    assert not eps["verified"] and eps["check"] == "replay", eps["verification"]
    assert eps["verification"].startswith("checked by replaying the culprit")
    assert "every parameter finite" in eps["verification"]
    assert any("your eps 1e-08 is zero in float16" in e for e in eps["evidence"])
    master = r.rec("fp32_master_weights")
    assert master["fix"] == ["fp32-master"]  # installable: --fix fp32-master
    assert "step_with_fp32_master(optimizer, masters)" in master["snippet"]
    assert any("model.float()" in e for e in master["evidence"])


# ----------------------------------------------------------------------------- norm eps


@pytest.mark.parametrize(("key", "script", "module", "text", "op"), [
    ("rmsnorm", "rmsnorm_eps_half_transformer.py", "blocks.0.norm1",
     "return (h * torch.rsqrt(", "aten.rsqrt"),
    ("layernorm", "layernorm_eps_half_cnn.py", "norm", "x = (x - u) / torch.sqrt(", "aten.div"),
])
def test_norm_eps_rounds_to_zero(runs, key, script, module, text, op):
    r = runs[key]
    assert r.code == 1
    f, d = r.report["first_failure"], r.diagnosis
    assert (f["phase"], f["module"], f["op"]) == ("forward", module, op)
    assert f["source"].endswith(f"{script}:{_line_of(script, text)}")
    assert (d["rule"], d["kind"]) == ("norm-eps", "underflow")
    assert d["data"]["eps"] == 1e-12
    assert d["data"]["becomes"] == torch.tensor(1e-12, dtype=torch.float16).item() == 0.0
    assert "1e-12" in d["message"] and "0 in float16" in d["message"]
    assert {x["type"] for x in r.report["recommendations"]} >= {"eps", "fp32_module"}


def test_a_nonzero_norm_eps_trains(runs, plain):
    assert all(math.isfinite(v) for v in plain["layernorm_fixed"])
    assert runs["ok_rmsnorm"].code == 0


def test_norm_eps_op_matches_an_independent_locator():
    ns = runpy.run_path(str(SCRIPTS / "rmsnorm_eps_half_transformer.py"), run_name="reference")
    torch.manual_seed(0)
    model = ns["TinyLM"](eps=1e-12).half()
    tokens = torch.randint(1, 64, (8, 12))
    tokens[:, 8:] = 0
    with FirstNonFinite() as mode:
        model(tokens)
    assert mode.first == "aten.rsqrt"


# ----------------------------------------------------------------------------- unnormalised input


def _first_batch_pixels() -> torch.Tensor:
    torch.manual_seed(0)  # the script's data, regenerated (it is made before anything else)
    return torch.randint(0, 65536, (64, 1, 16, 16), dtype=torch.int32)[:16].float()


@pytest.mark.parametrize(("key", "module"), [("pixels", "stem"), ("tabular", "0")])
def test_unnormalised_input_is_bad_input(runs, plain, key, module):
    r = runs[key]
    assert r.code == 1
    f, d = r.report["first_failure"], r.diagnosis
    assert (f["phase"], f["module"]) == ("forward", module)
    assert (d["rule"], d["kind"], d["phase"], d["module"]) == ("input-range", "bad_input",
                                                               "data", module)
    assert d["data"]["amax"] > 64
    recs = [x["type"] for x in r.report["recommendations"]]
    assert recs[0] == "normalize_input"
    if key == "pixels":
        batch = _first_batch_pixels()
        assert d["data"]["min"] == float(batch.min()) and d["data"]["max"] == float(batch.max())
        assert "/ 65535.0" in r.rec("normalize_input")["snippet"]
    # the float32 control of the same script trains: the range, not the model, is the problem
    assert all(math.isfinite(v) for v in plain[f"{key}_fp32"])


@pytest.mark.parametrize("arch", ["mlp", "conv1d"])
def test_a_non_finite_loss_target_is_bad_data(runs, plain, arch):
    # references: the script's own data (the -inf targets and their batch positions, from
    # torch.log of the zeros), and its losses under plain python (inf at that step only)
    ns = runpy.run_path(str(SCRIPTS / "log_target_zero.py"), run_name="not_main")
    _, y = ns["make_data"](arch)
    batch = ns["BATCH"]
    bad = torch.nonzero(~torch.isfinite(y[:, 0])).flatten().tolist()
    step = bad[0] // batch
    losses = plain[f"logtarget_{arch}"]
    assert [i for i, v in enumerate(losses) if not math.isfinite(v)] == [step]
    r = runs[f"logtarget_{arch}"]
    assert r.code == 1
    f, d = r.report["first_failure"], r.diagnosis
    assert (f["step"], f["phase"], f["module"]) == (step, "data", "")
    assert f["tensor"] == "target of MseLoss"
    assert f["stats"]["neginf"] == len(bad) and f["stats"]["nan"] == 0
    assert (d["rule"], d["kind"], d["phase"]) == ("bad-input", "bad_input", "data")
    positions = [i - step * batch for i in bad]
    assert any(f"batch positions {', '.join(map(str, positions))}" in e for e in d["evidence"])
    assert r.report["recommendations"][0]["type"] == "fix_data"


# ----------------------------------------------------------------------------- healthy controls


@pytest.mark.parametrize("key", [k for k in RUNS if k.startswith("ok_")])
def test_healthy_controls_stay_quiet(runs, key):
    r = runs[key]
    assert r.code == 0, (r.diagnosis, r.stderr[-2000:])
    assert r.diagnosis is None
    assert r.report["first_failure"] is None
    bad = [w for w in r.report["warnings"]
           if w["rule"] in ("scaler-misuse", "input-range", "norm-eps", "optimizer-eps")]
    assert not bad
    assert not r.report["loop_calls"]
