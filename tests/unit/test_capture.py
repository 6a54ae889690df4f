"""The core engine on small CPU models: where the first non-finite value appeared."""

from __future__ import annotations

import gc
import math
import weakref
from collections import namedtuple

import pytest
import torch
from torch import nn

import nanhunt
import nanhunt.stats as stats_module
from nanhunt import capture

# ----------------------------------------------------------------------------- models


class FFN(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.wi = nn.Linear(d, 4 * d)
        self.act = nn.ReLU()
        self.wo = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.wo(self.act(self.wi(x)))


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.ffn = FFN(d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.ffn(x))


class Encoder(nn.Module):
    def __init__(self, d: int = 8, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Net(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.encoder = Encoder(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.encoder(x))


def amp_step(model, opt, scaler, x, y, crit=None):
    crit = crit or nn.CrossEntropyLoss()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = crit(model(x), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def batches(n, d=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, d, generator=g), torch.randint(0, 2, (16,), generator=g))
            for _ in range(n)]


# ----------------------------------------------------------------------------- failures


def test_forward_overflow_in_named_submodule():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with nanhunt.watch(model, opt, scaler) as hunt:
        for step, (x, y) in enumerate(batches(5)):
            if step == 3:
                with torch.no_grad():
                    model.encoder.blocks[1].ffn.wo.weight.mul_(1e6)
            amp_step(model, opt, scaler, x, y)
    f = hunt.first_failure
    assert (f.step, f.phase, f.module, f.tensor) == (3, "forward", "encoder.blocks.1.ffn.wo",
                                                     "output")
    assert f.stats.nonfinite > 0
    # everything before step 3 was finite, and every step is recorded (skipped ones too)
    assert [s.index for s in hunt.steps] == [0, 1, 2, 3, 4]
    assert [s.skipped for s in hunt.steps] == [False, False, False, True, True]
    assert all(torch.isfinite(torch.tensor(s.loss)) for s in hunt.steps[:3])


def test_backward_only_nan_is_found_in_backward():
    class Norm(nn.Module):
        def forward(self, x):
            return torch.sqrt((x * x).sum(-1, keepdim=True))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.norm = Norm()

        def forward(self, x):
            return self.norm(self.fc(x))

    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt) as hunt:
        for step in range(3):
            x = torch.randn(5, 4)
            if step == 1:
                with torch.no_grad():
                    model.fc.weight.zero_()
                    model.fc.bias.zero_()
            opt.zero_grad()
            out = model(x)
            if step <= 1:
                assert torch.isfinite(out).all()
            out.mean().backward()
            opt.step()
    f = hunt.first_failure
    assert (f.step, f.phase, f.module, f.tensor) == (1, "backward", "norm", "grad_input[0]")


def test_optimizer_step_makes_fp16_weights_non_finite():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=6e4)
    x = (torch.randn(16, 4) * 10).half()
    with nanhunt.watch(model, opt) as hunt:
        for _ in range(3):
            opt.zero_grad()
            loss = (model(x).float() * 100).pow(2).mean()
            loss.backward()
            opt.step()
    f = hunt.first_failure
    assert f.phase == "optimizer"
    assert f.step == 0
    assert f.module in ("0", "2")
    assert f.tensor in ("0.weight", "0.bias", "2.weight", "2.bias")
    assert hunt.steps[0].loss == pytest.approx(hunt.steps[0].loss)  # finite


def test_nan_in_batch_is_phase_data():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with nanhunt.watch(model, opt, scaler) as hunt:
        for step, (x, y) in enumerate(batches(5)):
            if step == 2:
                x[5, 3] = float("nan")
            amp_step(model, opt, scaler, x, y)
    f = hunt.first_failure
    assert (f.step, f.phase, f.module, f.tensor) == (2, "data", "Net", "input[0]")
    assert f.stats.nan == 1
    assert hunt.failure_extra["bad_samples"] == {"input[0]": [5]}


def test_nested_output_containers_are_walked():
    Out = namedtuple("Out", ["logits", "aux"])

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, *, scale):
            h = self.fc(x)
            return {"pair": (h + 1, h * 2), "named": Out(h * scale, [h.sum()])}

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            out = self.inner(x, scale=torch.tensor(float("inf")))
            return out["pair"][0].sum() + out["named"].logits.sum()

    model = Outer()
    with nanhunt.watch(model) as hunt:
        model(torch.randn(2, 4)).backward()
    f = hunt.first_failure
    # the kwarg 'scale' is the first non-finite value; it was made in Outer's own code
    assert f.phase == "forward"
    assert f.module == "Outer"
    assert f.tensor == "input['scale'] of inner"
    recs = {r.tensor for r in hunt.records(0) if r.module == "inner"}
    assert {"output['pair'][0]", "output['pair'][1]", "output['named'].logits",
            "output['named'].aux[0]"} <= recs


def test_module_called_twice_weight_sharing():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.big = nn.Parameter(torch.tensor(1.0))

        def forward(self, x):
            h = self.fc(x)          # first call: finite
            h = h * self.big
            return self.fc(h)       # second call: overflows in fp16

    torch.manual_seed(0)
    model = Shared().half()
    with torch.no_grad():
        model.big.fill_(1e4)
        model.fc.weight.fill_(1.0)
    with nanhunt.watch(model) as hunt:
        model(torch.ones(2, 4).half()).float().sum().backward()
    f = hunt.first_failure
    assert (f.module, f.tensor, f.phase) == ("fc", "output", "forward")
    layer = next(lay for lay in hunt.layers if lay.module == "fc")
    assert layer.calls == 2


def test_scaler_skip_alone_is_not_a_failure():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    with nanhunt.watch(model, opt, scaler) as hunt:
        for x, y in batches(12):
            amp_step(model, opt, scaler, x, y)
    assert hunt.first_failure is None
    skipped = [s.skipped for s in hunt.steps]
    assert skipped[0] is True and skipped[-1] is False
    assert hunt.steps[0].scale == 2.0**24
    assert hunt.steps[1].scale == 2.0**23
    assert any("skipped" in fact for fact in hunt.facts)
    assert [e.event for e in hunt.scaler_events][:1] == ["backoff"]


def _sqrt_at_zero_run(**hunt_kw):
    class Norm(nn.Module):
        def forward(self, x):
            return torch.sqrt((x * x).sum(-1, keepdim=True) * 0)

    model = nn.Sequential(nn.Linear(4, 4), Norm())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scales = []
    with nanhunt.watch(model, opt, scaler, **hunt_kw) as hunt:
        for _ in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(3, 4)).float().mean()
            opt.zero_grad()
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return hunt, scales


def test_a_skip_no_loss_scale_avoids_is_found_at_the_first_skip():
    # sqrt's derivative at 0 is inf whatever the scale: replayed with the gradient unscaled,
    # the module's backward is still non-finite, so the first skip is the failure
    hunt, scales = _sqrt_at_zero_run()
    assert scales[:4] == [8.0, 4.0, 2.0, 1.0]  # GradScaler halved it every step (reference)
    f = hunt.first_failure
    assert hunt.problem == "scale_free"
    assert (f.step, f.phase, f.module) == (0, "backward", "1")
    assert "unscaled" in f.detail and "no loss scale avoids them" in f.detail


def test_scale_collapse_is_a_loss_scaling_problem():
    # without kept tensors there is no replay: the collapse below scale 1 is what is seen
    hunt, _ = _sqrt_at_zero_run(keep_tensors=False)
    f = hunt.first_failure
    assert hunt.problem == "collapse"
    assert f.phase == "loss_scaling"
    assert f.step == 0  # the start of the run of skipped steps
    assert f.module == "1"


def test_calibration_skips_pass_the_unscaled_replay():
    # a scale far too high overflows the scaled gradients only: unscaled they are finite
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    with nanhunt.watch(model, opt, scaler) as hunt:
        for _ in range(30):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 4)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    skipped = [s.skipped for s in hunt.steps]
    assert sum(skipped) >= 10 and not skipped[-1]  # calibration happened (reference)
    assert hunt.first_failure is None and hunt.problem is None


def test_ring_buffer_is_bounded():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, opt, keep_steps=3) as hunt:
        for _ in range(10):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert len(hunt.recorder.ring) <= 3 + 1  # (the step in flight)
    assert len(hunt.steps) == 10
    assert hunt.records(9) and not hunt.records(2)


def test_one_transfer_per_step(monkeypatch):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    transfers = []
    real = torch.Tensor.cpu

    def counting_cpu(self, *a, **k):
        transfers.append(hunt.step)
        return real(self, *a, **k)

    hunt = nanhunt.Hunt(model, opt, scaler)
    hunt.start()
    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    try:
        for x, y in batches(4):
            amp_step(model, opt, scaler, x, y)
    finally:
        monkeypatch.undo()
        hunt.stop()
    assert transfers == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- sessions


def test_hooks_are_removed_even_when_the_step_raises():
    model = Net()

    class Boom(Exception):
        pass

    with pytest.raises(Boom), nanhunt.watch(model):
        model(torch.randn(2, 8))
        raise Boom
    assert capture._ACTIVE is None  # and the autouse fixture checks the hook tables


def test_second_concurrent_session_is_refused():
    with nanhunt.watch(nn.Linear(2, 2)), pytest.raises(nanhunt.NanhuntError, match="already"):
        nanhunt.Hunt().start()


def test_no_reference_keeps_the_model_alive():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, opt) as hunt:
        for x, y in batches(2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    ref = weakref.ref(model)
    del model, opt, x, y
    gc.collect()
    assert ref() is None
    assert hunt.steps  # the results outlive the model


def test_start_stop_api_and_layers():
    model = Net()
    hunt = nanhunt.Hunt(model)
    hunt.start()
    try:
        model(torch.randn(3, 8)).sum().backward()
        hunt.end_step()
    finally:
        hunt.stop()
    names = [lay.module for lay in hunt.layers]
    assert "encoder.blocks.0.ffn.wi" in names and "head" in names
    wi = next(lay for lay in hunt.layers if lay.module == "encoder.blocks.0.ffn.wi")
    assert wi.forward.amax > 0 and wi.backward.amax > 0 and wi.param_grad.amax > 0
    assert wi.type == "Linear"


# ----------------------------------------------------------------------------- no change


def _train(use_hunt: bool, half: bool) -> tuple[list[float], dict]:
    torch.manual_seed(1234)
    model = Net()
    if half:
        model = model.half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4 if half else 1e-8)
    scaler = torch.amp.GradScaler("cpu", enabled=not half)
    losses = []
    hunt = nanhunt.Hunt(model, opt, scaler) if use_hunt else None
    if hunt:
        hunt.start()
    try:
        for x, y in batches(6):
            if half:
                loss = nn.functional.cross_entropy(model(x.half()).float(), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            else:
                loss = amp_step(model, opt, scaler, x, y)
            losses.append(loss.item())
    finally:
        if hunt:
            hunt.stop()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("half", [False, True], ids=["autocast+scaler+adamw", "half"])
def test_nanhunt_changes_nothing(half):
    plain_losses, plain_state = _train(False, half)
    hunt_losses, hunt_state = _train(True, half)
    assert plain_losses == hunt_losses
    for k in plain_state:
        assert torch.equal(plain_state[k], hunt_state[k]), k


def test_sampled_mode_traces_every_nth_step_and_escalates_on_failure():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with nanhunt.watch(model, opt, scaler, sample_every=4) as hunt:
        for step, (x, y) in enumerate(batches(9)):
            if step == 5:
                x[0, 0] = float("nan")
            amp_step(model, opt, scaler, x, y)
            if step == 1:
                from torch.nn.modules import module as M

                assert not M._global_forward_hooks  # dropped between sampled steps
    layers = {r.module for r in hunt.records(0)}
    assert "encoder.blocks.0.ffn.wi" in layers
    assert {r.role for r in hunt.records(1)} == {"loss", "param"}  # the cheap checks
    f = hunt.first_failure
    assert (f.step, f.tensor) == (5, "loss")  # found by the cheap check, in an unsampled step
    assert any(r.module == "encoder.blocks.0.ffn.wi" for r in hunt.records(6))  # escalated


def test_memory_is_bounded_over_a_long_run(monkeypatch):
    monkeypatch.setattr(capture.recorder, "HISTORY", 40)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, opt, keep_steps=5) as hunt:
        for _ in range(130):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert len(hunt.steps) == 40 and hunt.steps[-1].index == 129
    assert len(hunt.recorder.ring) <= 5 + 1
    layer = hunt.layers[0]
    assert len(layer.forward_amax_by_step) <= 40 + 4
    assert layer.calls == 130  # the aggregate ranges still cover the whole run


def test_compiled_model_runs_untraced_inside_and_does_not_break():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanhunt.watch(model, opt) as hunt:
        compiled = torch.compile(model, backend="eager")
        for _ in range(2):
            opt.zero_grad()
            compiled(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
    assert [s.index for s in hunt.steps] == [0, 1]
    assert all(s.loss is not None and s.grad_norm is not None for s in hunt.steps)
    assert hunt.first_failure is None


def test_optimizer_step_on_scaled_gradients_is_flagged_and_diagnosed():
    from nanhunt.pipeline import analyse

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with nanhunt.watch(model, opt, scaler) as hunt:
        for x, y in batches(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            opt.step()  # the bug: scaler.step(opt) unscales first; no scaler.update() either
    assert hunt.steps[0].misuse == ["optimizer_on_scaled_grads"]
    assert len(hunt.steps) == 3  # steps still end without scaler.update()
    trace = analyse(hunt.trace(), hunt.snapshot)
    assert trace.diagnosis.rule == "scaler-misuse"
    assert trace.diagnosis.kind == "loss_scale"
    assert "65536" in trace.diagnosis.message
    assert trace.recommendations[0].type == "scaler_usage"
    assert "scaler.step(optimizer)" in trace.recommendations[0].snippet


def test_correct_scaler_use_is_not_flagged():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with nanhunt.watch(model, opt, scaler) as hunt:
        for x, y in batches(3):
            amp_step(model, opt, scaler, x, y)
    assert all(not s.misuse for s in hunt.steps)


def test_clipping_before_unscale_is_flagged():
    from nanhunt.pipeline import analyse

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with nanhunt.watch(model, opt, scaler) as hunt:
        for i, (x, y) in enumerate(batches(4)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            if i >= 2:
                scaler.unscale_(opt)  # the right order from step 2 on
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    assert [s.misuse for s in hunt.steps] == [["clip_on_scaled_grads"]] * 2 + [[], []]
    trace = analyse(hunt.trace(), hunt.snapshot)
    assert trace.diagnosis.rule == "scaler-misuse"
    assert "scaler.unscale_(optimizer)" in trace.diagnosis.message


def test_gradient_norm_is_taken_before_clipping():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, opt) as hunt:
        opt.zero_grad()
        (model(torch.full((8, 4), 10.0)) * 100).sum().backward()
        expected = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert hunt.steps[0].grad_norm == pytest.approx(expected, rel=1e-5)
    assert expected > 100


def test_a_model_called_through_a_method_is_named_inside_it(tmp_path):
    class VAE(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Linear(4, 2)
            self.decoder = nn.Sequential(nn.Linear(2, 4), nn.Tanh())

        def decode(self, z):
            return self.decoder(z)

    vae = VAE()
    hunt = nanhunt.Hunt()  # no model given: names are found as the CLI finds them
    with hunt:
        vae.decode(torch.randn(3, 2)).sum().backward()
        hunt.end_step()
    names = {lay.module for lay in hunt.layers}
    assert {"decoder", "decoder.0", "decoder.1"} <= names, names


def test_a_nan_in_the_targets_of_a_functional_loss_is_bad_data():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, opt) as hunt:
        for step in range(3):
            target = torch.randn(6, 1)
            if step == 1:
                target[4, 0] = float("inf")
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(6, 4)), target).backward()
            opt.step()
    f = hunt.first_failure
    assert (f.step, f.phase, f.tensor) == (1, "data", "target of MseLoss")
    assert hunt.failure_extra["bad_samples"] == {"target of MseLoss": [4]}


def test_a_bug_in_nanhunt_stops_tracing_but_never_the_training(monkeypatch, capsys):
    def broken(t, fmt):
        raise RuntimeError("simulated nanhunt bug")

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    monkeypatch.setattr(stats_module, "summarize", broken)
    with nanhunt.watch(model, opt, scaler) as hunt:
        losses = [amp_step(model, opt, scaler, x, y).item() for x, y in batches(3)]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert hunt.internal_errors and "simulated nanhunt bug" in hunt.internal_errors[0]
    assert "tracing stopped, your run continues" in capsys.readouterr().err
    assert any("internal error" in n for n in hunt.trace().notes)


# ----------------------------------------------------------------------------- review fixes


def test_inference_mode_passes_do_not_stop_tracing():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, opt) as hunt:
        for step in range(4):
            if step == 1:
                with torch.inference_mode():
                    model(torch.randn(2, 4))
            x = torch.randn(3, 4)
            if step == 3:
                x[1, 1] = float("nan")
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    assert not hunt.internal_errors
    assert (hunt.first_failure.step, hunt.first_failure.phase) == (3, "data")


def test_lazy_modules_are_watched_once_materialised():
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 1))
    opt = None
    with nanhunt.watch(model) as hunt:
        for step in range(3):
            x = torch.randn(3, 5)
            if step == 2:
                x[0, 0] = float("inf")
            out = model(x)
            if opt is None:
                opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            opt.zero_grad()
            out.sum().backward()
            opt.step()
    assert not hunt.internal_errors
    assert (hunt.first_failure.step, hunt.first_failure.phase) == (2, "data")
    assert any(r.role == "param_grad" and r.tensor == "0.weight.grad" for r in hunt.records(1))


def test_a_module_returning_its_input_keeps_the_batch_as_data():
    model = nn.Sequential(nn.Identity(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(5, 4)
    x[2, 0] = float("nan")
    with nanhunt.watch(model, opt) as hunt:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    f = hunt.first_failure
    assert (f.phase, f.tensor) == ("data", "input[0]")
    assert hunt.failure_extra["bad_samples"] == {"input[0]": [2]}


def test_inference_loops_are_stepped_per_call_and_hold_nothing():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    with nanhunt.watch(model) as hunt, torch.no_grad():
        for _ in range(20):
            model(torch.randn(32, 64))
            assert not any(not isinstance(v[2], weakref.ref) for v in hunt.cur.seen.values())
    assert len(hunt.steps) == 20


@pytest.mark.parametrize("seed", [7, 8])  # (seeds where a freed loss's id was once reused)
def test_a_float32_side_optimizer_is_not_scaler_misuse(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    probe = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with nanhunt.watch(model, opt, scaler) as hunt:
        for x, y in batches(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            probe_opt.zero_grad()
            probe(x).pow(2).mean().backward()  # its own, unscaled loss
            probe_opt.step()
            scaler.step(opt)
            scaler.update()
    assert all(not s.misuse for s in hunt.steps)


@pytest.mark.parametrize("pass_optimizer", [True, False])
def test_gradient_accumulation_is_one_step_per_optimizer_step(pass_optimizer):
    model = nn.Linear(4, 1)
    hunt = nanhunt.Hunt(model)
    with hunt:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # made under the session, as in a script
        if pass_optimizer:
            hunt._optimizer_exists = True
        for _ in range(2):
            opt.zero_grad()
            for _ in range(3):  # three micro-batches
                model(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert [s.index for s in hunt.steps] == [0, 1]


def test_a_loop_without_any_optimizer_still_has_steps():
    model = nn.Linear(4, 1)
    with nanhunt.watch(model) as hunt:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 1e-3 * p.grad
                    p.grad = None
    assert len(hunt.steps) == 3


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
@pytest.mark.parametrize("where", ["between", "start"])
def test_zero_grad_between_unscale_and_step_is_loop_misuse(arch, where):
    torch.manual_seed(0)
    if arch == "mlp":
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        def batch():
            return torch.randn(4, 8)
    else:
        model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(1))
        def batch():
            return torch.randn(4, 1, 6, 6)
    model(batch())  # (materialise the lazy layer)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    before = [p.detach().clone() for p in model.parameters()]
    with nanhunt.watch(model, opt, scaler) as hunt:
        for _ in range(3):
            if where == "start":
                opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(batch()).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if where == "between":
                opt.zero_grad()
            scaler.step(opt)
            scaler.update()
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    codes = [c.code for c in hunt.trace().loop_calls]
    if where == "between":
        assert not moved  # the reference: no update was ever applied
        assert codes == ["zero_grad_after_unscale"]
        call = hunt.trace().loop_calls[0]
        assert call.source_line == "opt.zero_grad()" and call.steps == 3
    else:
        assert moved and codes == []


def test_a_removed_global_forward_hook_takes_its_with_kwargs_flag():
    """torch's handle of ``register_module_forward_hook(..., with_kwargs=True)`` leaves its flag
    in ``_global_forward_hooks_with_kwargs`` when removed, and that flag alone makes every later
    compiled module call warn into the user's stderr (sampled mode removes its hooks between
    sampled steps). nanhunt's registration takes the flag out with the hook."""
    from torch.nn.modules import module as _M

    from nanhunt.capture.compiled import global_forward_hook

    def hook(module, args, kwargs, output):
        return None

    plain = _M.register_module_forward_hook(hook, with_kwargs=True)
    plain.remove()
    assert plain.id in _M._global_forward_hooks_with_kwargs  # torch's own handle: left behind
    _M._global_forward_hooks_with_kwargs.pop(plain.id)
    ours = global_forward_hook(hook)
    assert ours.id in _M._global_forward_hooks_with_kwargs
    ours.remove()
    assert ours.id not in _M._global_forward_hooks_with_kwargs
    assert not _M._has_any_global_hook()
