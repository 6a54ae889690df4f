"""The sentinel: cheap checks every step, the failing step replayed with full tracing.

The reference for every planted failure is an independent full-tracing :class:`nanhunt.Hunt`
run of the same script (same seeds, same batches): the sentinel must name the same first
failure without tracing the 40 steps before it. Every planted failure runs in an MLP (with
dropout, so the replay must restore the RNG) and in a CNN.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt
from nanhunt.capture import StopRun

AT, STEPS = 20, 30  # late: after the calibration skips (< 10) and 19 untraced steps


def build(arch: str) -> nn.Module:
    if arch == "mlp":
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32),
                             nn.ReLU(), nn.Linear(32, 1))
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 1))


def batch(arch: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (16, 8) if arch == "mlp" else (8, 1, 6, 6)
    return torch.randn(*shape, generator=g), torch.randn(shape[0], 1, generator=g)


def train(arch: str, plant: str | None, scaled: bool, session=None, steps: int = STEPS,
          on_step=None):
    """One script: autocast fp16 on the CPU, SGD, optionally a GradScaler; ``plant`` makes
    step AT fail (``forward``/``backward``/``optimizer`` keep failing after it)."""
    torch.manual_seed(0)
    model = build(arch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    g = torch.Generator().manual_seed(1)
    s = session(model, opt, scaler) if session else contextlib.nullcontext()
    losses = []
    with s:
        for i in range(steps):
            x, y = batch(arch, g)
            if plant == "forward" and i >= AT:
                x = x * 1e5  # overflows float16 in the first layer
            if plant == "batch" and i == AT:
                x[3].view(-1)[2] = float("nan")
            if plant == "optimizer" and i == AT:
                for group in opt.param_groups:
                    group["lr"] = 3e38  # the update overflows float32
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            if plant == "backward" and i >= AT:
                out = torch.sqrt(out.float() - out.float().detach())  # 0 forward, inf backward
            loss = 100 * (out.float() - y).pow(2).mean()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(i)
    return s, losses, [p.detach().clone() for p in model.parameters()]


def where(f):
    return None if f is None else (f.step, f.phase, f.module, f.tensor)


def reference(arch: str, plant: str, scaled: bool):
    from nanhunt.pipeline import analyse

    hunt, _, _ = train(arch, plant, scaled, lambda m, o, s: nanhunt.Hunt(m, o, s))
    trace = analyse(hunt.trace(), hunt.snapshot)
    return hunt, trace


PLANTS = ["forward", "backward", "batch", "optimizer"]


def _late_cases() -> list:
    """Every (architecture, plant, scaler) case; the default suite runs half, pairwise: each
    architecture with every plant, each plant with and without GradScaler (the rest: -m
    slow)."""
    cases = []
    for arch in ("mlp", "cnn"):
        for i, plant in enumerate(PLANTS):
            for scaled in (False, True):
                default = scaled == ((i + (arch == "cnn")) % 2 == 1)
                name = f"{arch}-{plant}-{'gradscaler' if scaled else 'no-scaler'}"
                cases.append(pytest.param(arch, plant, scaled, id=name,
                                          marks=() if default else pytest.mark.slow))
    return cases


@pytest.mark.parametrize(("arch", "plant", "scaled"), _late_cases())
def test_late_failure_is_diagnosed_like_full_tracing(arch, plant, scaled, tmp_path):
    hunt, ref = reference(arch, plant, scaled)
    assert hunt.first_failure is not None and hunt.first_failure.step == AT  # the plant works
    out = tmp_path / "report"
    sent, _, _ = train(arch, plant, scaled,
                       lambda m, o, s: nanhunt.sentinel(m, o, s, out=out))
    assert sent.internal_errors == []
    assert where(sent.first_failure) == where(hunt.first_failure)
    # in full: the report on disk carries the same failure and the same diagnosis
    report = json.loads((out / "report.json").read_text())
    f = report["first_failure"]
    assert (f["step"], f["phase"], f["module"], f["tensor"]) == where(hunt.first_failure)
    assert report["run"]["mode"] == "sentinel"
    assert ref.diagnosis is not None
    assert report["diagnosis"]["kind"] == ref.diagnosis.kind
    # and without tracing the steps before it: step 10 holds the cheap rows only
    early = next(s for s in sent.steps if s.index == 10)
    n_params = len(list(build(arch).parameters()))
    assert early.records <= 2 * n_params + 1 < next(s for s in hunt.steps if s.index == 10).records
    if plant != "optimizer":
        assert "reproduced" in " ".join(sent.notes)
        assert [s.index for s in sent.replay.hunt.steps] == [AT]  # one step replayed


@pytest.mark.parametrize("scaled", [False, True], ids=["no-scaler", "gradscaler"])
@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_healthy_run_stays_quiet(arch, scaled, tmp_path):
    out = tmp_path / "report"
    sent, _, _ = train(arch, None, scaled, lambda m, o, s: nanhunt.sentinel(m, o, s, out=out))
    assert sent.first_failure is None and sent.notes == [] and sent.internal_errors == []
    assert not out.exists()
    assert len(sent.steps) == STEPS
    if scaled:  # GradScaler's calibration skips at the default scale are facts, not trips
        skipped = [s.index for s in sent.steps if s.skipped]
        assert skipped and all(i < 10 for i in skipped)
        assert sum("skipped the step" in f for f in sent.facts) == len(skipped)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.nan_to_num(7.0, 8.0, 9.0), y.nan_to_num(7.0, 8.0, 9.0))
               for x, y in zip(a, b))


@pytest.mark.parametrize("scaled", [False, True], ids=["no-scaler", "gradscaler"])
@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_losses_and_parameters_are_bit_identical(arch, scaled, tmp_path):
    # the plant keeps failing after AT; with ``out`` the replay, the analysis and the reports
    # all run (the MLP has dropout: they must not draw from the user's generator)
    _, plain_losses, plain_params = train(arch, "forward", scaled)
    out = tmp_path / "report"
    sent, losses, params = train(arch, "forward", scaled,
                                 lambda m, o, s: nanhunt.sentinel(m, o, s, out=out))
    assert sent.first_failure is not None and (out / "report.json").exists()
    assert [repr(x) for x in losses] == [repr(x) for x in plain_losses]
    assert _same(params, plain_params)


class DropBlock(nn.Module):
    """Module dropout and functional dropout, and an output that overflows float16 when the
    batch is large (the issue's reproduction: the culprit itself draws random numbers)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        h = F.dropout(self.drop(self.fc(x)), 0.1, self.training)
        return h * h * x.abs().amax()


def _seeded_loop(session=None, scaled=True, steps=12, bad=6):
    """A seeded loop (SGD, fp16 autocast, optionally GradScaler) whose step ``bad`` overflows;
    the loop also draws from Python's and numpy's generators, as data code does. Returns the
    session, the losses, the parameters after every step and the loop's own draws."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = nn.Sequential(DropBlock(), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    s = session(model, opt, scaler) if session else contextlib.nullcontext()
    losses, params, draws = [], [], []
    with s:
        for i in range(steps):
            x, y = torch.randn(16, 8), torch.randn(16, 1)
            if i == bad:
                x = x * 100
            draws.append((random.random(), float(np.random.rand())))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = (out.float() - y).pow(2).mean()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                for p in model.parameters():  # the loop's own guard keeps the weights finite
                    p.grad.nan_to_num_(0.0, 0.0, 0.0)
                opt.step()
            losses.append(loss.item())
            params.append([p.detach().clone() for p in model.parameters()])
    return s, losses, params, draws


@pytest.mark.parametrize("scaled", [True, False], ids=["gradscaler", "no-scaler"])
def test_training_after_a_trip_is_bit_identical_with_the_analysis_and_reports(scaled, tmp_path):
    _, plain_losses, plain_params, plain_draws = _seeded_loop(scaled=scaled)
    out = tmp_path / "report"
    sent, losses, params, draws = _seeded_loop(
        lambda m, o, s: nanhunt.sentinel(m, o, s, out=out, stop=False), scaled=scaled)
    # the analysis really ran: the failure was replayed, diagnosed and reported
    assert sent.first_failure is not None and sent.first_failure.step == 6
    assert "reproduced" in " ".join(sent.notes) and (out / "report.json").exists()
    assert sent.internal_errors == []
    # and every step, before and after the trip, is the plain run's, bit for bit
    assert [repr(x) for x in losses] == [repr(x) for x in plain_losses]
    for step, (a, b) in enumerate(zip(params, plain_params)):
        assert _same(a, b), f"parameters differ after step {step}"
    assert draws == plain_draws


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_stop_ends_the_block_after_the_failing_step(arch, tmp_path):
    seen = []
    sent, _, _ = train(arch, "batch", False, lambda m, o, s: nanhunt.sentinel(
        m, o, s, out=tmp_path / "r", stop=True), on_step=seen.append)
    # the failing step ran to its end (the analysis waits for the user's step to return);
    # the script stopped before the next step's forward, where the analysis ran
    assert seen[-1] == AT
    assert sent.first_failure.step == AT and (tmp_path / "r" / "report.json").exists()


def test_a_trip_in_the_last_step_is_analysed_when_the_session_stops(tmp_path):
    out = tmp_path / "r"
    sent, _, _ = train("mlp", "batch", False, lambda m, o, s: nanhunt.sentinel(
        m, o, s, out=out), steps=AT + 1)
    assert where(sent.first_failure) == (AT, "data", "Sequential", "input[0]")
    assert (out / "report.json").exists()


def test_capture_never_imports_the_pipeline_or_the_replay():
    import ast
    from pathlib import Path

    capture = Path(nanhunt.__file__).parent / "capture"
    for path in capture.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                target = "." * node.level + node.module
                assert not target.lstrip(".").startswith(("pipeline", "replay")), \
                    f"{path.name} imports {target}"


def test_start_stop_without_with_and_stop_raises():
    model = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    s = nanhunt.sentinel(model, opt, out=None, stop=True).start()
    try:
        with pytest.raises(StopRun):
            for i in range(5):
                x = torch.randn(4, 8)
                if i == 3:
                    x[0, 0] = float("nan")
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
    finally:
        s.stop()
    assert where(s.first_failure) == (3, "data", "Sequential", "input[0]")


class Flaky(nn.Module):
    """Overflows on its 41st and 43rd calls only: a copy (one call ahead) does not."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x * (1e5 if self.calls in (AT + 1, AT + 3) else 1.0))


def _flaky_run(arch: str, session):
    torch.manual_seed(0)
    model = nn.Sequential(Flaky(8), nn.ReLU(), nn.Linear(8, 1)) if arch == "mlp" else \
        nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), Flaky(72), nn.Linear(72, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")  # skips the failing steps: the weights stay finite
    g = torch.Generator().manual_seed(1)
    with session(model, opt, scaler) as s:
        for _ in range(AT + 5):
            x, _y = batch(arch, g)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return s


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_a_replay_that_does_not_reproduce_switches_to_full_tracing(arch):
    sent = _flaky_run(arch, lambda m, o, s: nanhunt.sentinel(m, o, s, out=None))
    notes = " ".join(sent.notes)
    assert f"step {AT} failed" in notes and "did not reproduce" in notes
    assert f"full tracing from step {AT + 1}" in notes
    assert next(s for s in sent.steps if s.index == AT + 1).records > 10  # traced
    # the next occurrence, traced in full, fails where full tracing saw the first one fail
    ref = _flaky_run(arch, lambda m, o, s: nanhunt.Hunt(m, o, s)).first_failure
    f = sent.first_failure
    assert ref.step == AT and f.step == AT + 2
    assert (f.phase, f.module, f.tensor) == (ref.phase, ref.module, ref.tensor)


class Buggy:
    """A torch.compile backend whose kernels return NaN while ``on`` (a compiler bug)."""

    def __init__(self):
        self.on = False

    def __call__(self, gm, example_inputs):
        def run(*args):
            outs = gm(*args)
            if not self.on:
                return outs
            return [o * math.nan if isinstance(o, torch.Tensor) and o.is_floating_point()
                    else o for o in outs]
        return run


def _compiled_run(arch: str, backend, session, plant_forward: bool):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = build(arch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about global hooks and compile
        s = session(model, opt)
        with s:
            cm = torch.compile(model, backend=backend)
            for i in range(AT + 3):
                x, y = batch(arch, g)
                if plant_forward and i >= AT:
                    x = x * 1e5
                if isinstance(backend, Buggy):
                    backend.on = i == AT
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = (cm(x).float() - y).pow(2).mean()
                loss.backward()
                opt.step()
    torch._dynamo.reset()
    return s


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_compiled_model_failure_is_named_to_its_layer(arch):
    sent = _compiled_run(arch, "eager", lambda m, o: nanhunt.sentinel(m, o, out=None), True)
    # reference: full tracing of the same model, not compiled
    hunt, _, _ = train(arch, "forward", False, lambda m, o, s: nanhunt.Hunt(m, o, s),
                       steps=AT + 3)
    assert where(sent.first_failure) == where(hunt.first_failure)
    assert sent.first_failure.module not in ("cm", "Sequential")  # a layer inside it
    assert "replayed eagerly" in " ".join(sent.notes)


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_compiled_only_nan_is_reported_as_such(arch):
    sent = _compiled_run(arch, Buggy(), lambda m, o: nanhunt.sentinel(m, o, out=None), False)
    f = sent.first_failure
    # the compiled wrapper of the model the session was given carries the model's name
    assert (f.step, f.phase, f.module, f.tensor) == (AT, "forward", "Sequential", "output")
    assert "only in the compiled code" in f.detail and "eager replay" in f.detail
    assert f.stats.nan > 0


def test_without_a_model_the_roots_are_learned():
    model = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanhunt.sentinel(out=None) as sent:
        for i in range(AT + 2):
            x = torch.randn(16, 8)
            if i == AT:
                x[1, 1] = math.inf
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    assert where(sent.first_failure) == (AT, "data", "model", "input[0]")


def _closure_run(arch: str, session):
    torch.manual_seed(0)
    model = build(arch)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    g = torch.Generator().manual_seed(1)
    with session(model, opt) as s:
        for i in range(15):
            x, _y = batch(arch, g)

            def closure(x=x, i=i):
                opt.zero_grad()
                out = model(x)
                if i >= 10:
                    out = torch.sqrt(out - out.detach())  # a backward-only inf from step 10
                loss = out.pow(2).mean()
                loss.backward()
                return loss

            opt.step(closure)
    return s


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_optimizer_closure_steps_are_checked_after_the_closure(arch):
    ref = _closure_run(arch, lambda m, o: nanhunt.Hunt(m, o)).first_failure
    sent = _closure_run(arch, lambda m, o: nanhunt.sentinel(m, o, out=None))
    assert ref.step == 10 and where(sent.first_failure) == where(ref)
    assert "reproduced" in " ".join(sent.notes)


class InnerAutocast(nn.Module):
    """Autocast entered inside the forward (accelerate wraps ``model.forward`` this way)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.b(torch.relu(self.a(x))).float()


@pytest.mark.parametrize("given", [True, False], ids=["model-given", "roots-learned"])
@pytest.mark.parametrize("inner", [True, False], ids=["inside-forward", "around-forward"])
def test_the_target_of_a_bf16_autocast_run_is_bfloat16(inner, given):
    model = InnerAutocast()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.sentinel(model if given else None, opt if given else None, out=None) as sent:
        for _ in range(3):
            opt.zero_grad()
            if inner:
                loss = model(torch.randn(2, 4)).sum()
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model.b(model.a(torch.randn(2, 4))).float().sum()
            loss.backward()
            opt.step()
    assert (sent.target, sent.target_source) == ("bfloat16", "autocast")


def test_a_replay_over_the_copy_cap_is_refused_and_said(tmp_path, monkeypatch):
    # a cap below the model's size: nothing is copied or replayed, the report says what it
    # would have copied, and names no cause for what it did not replay; training is unchanged
    monkeypatch.setenv("NANHUNT_REPLAY_MAX_BYTES", "1000")
    _, plain_losses, _, _ = _seeded_loop(scaled=True)
    out = tmp_path / "report"
    sent, losses, _, _ = _seeded_loop(lambda m, o, s: nanhunt.sentinel(m, o, s, out=out),
                                      scaled=True)
    notes = " ".join(sent.notes)
    assert "more than the cap of 1000 B" in notes and "NANHUNT_REPLAY_MAX_BYTES" in notes
    assert sent.first_failure.step == 6 and sent.first_failure.observed is False
    report = json.loads((out / "report.json").read_text())
    assert report["diagnosis"]["rule"] == "untraced-step" and report["diagnosis"]["kind"] == ""
    assert "not replayed" in report["diagnosis"]["message"]
    assert [repr(x) for x in losses] == [repr(x) for x in plain_losses]


def test_a_bug_in_the_analysis_still_writes_the_report(tmp_path, monkeypatch):
    from nanhunt.replay import step

    def broken(*args, **kwargs):
        raise RuntimeError("simulated bug in the replay")

    monkeypatch.setattr(step, "replay_step", broken)
    out = tmp_path / "report"
    _, plain_losses, _, _ = _seeded_loop(scaled=True)
    sent, losses, _, _ = _seeded_loop(lambda m, o, s: nanhunt.sentinel(m, o, s, out=out),
                                      scaled=True)
    assert sent.internal_errors and "simulated bug in the replay" in sent.internal_errors[0]
    report = json.loads((out / "report.json").read_text())
    assert any("simulated bug in the replay" in n for n in report["notes"])
    assert [repr(x) for x in losses] == [repr(x) for x in plain_losses]
