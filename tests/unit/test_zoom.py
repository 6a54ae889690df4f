"""Op-level zoom, snapshots and verification on small CPU modules."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

import nanhunt
from nanhunt.pipeline import analyse
from nanhunt.replay import files, module, show


class LogLoss(nn.Module):
    def forward(self, p, y):
        picked = p.gather(1, y[:, None])
        return -torch.log(picked).mean()  # log(0) when a probability is 0


class RMS(nn.Module):
    def forward(self, x):
        rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True))  # sqrt(0): inf derivative
        return x / rms.clamp_min(1e-3)


def test_forward_op_and_source_line_of_a_log_of_zero():
    model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(-1))
    criterion = LogLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt) as hunt:
        with torch.no_grad():
            model[0].weight.zero_()
            model[0].bias.copy_(torch.tensor([0.0, 200.0, 0.0]))  # softmax -> exactly 0
        loss = criterion(model(torch.randn(5, 4)), torch.zeros(5, dtype=torch.long))
        opt.zero_grad()
        loss.backward()
        opt.step()
    f = hunt.first_failure
    assert (f.step, f.phase, f.module, f.tensor) == (0, "forward", "criterion", "output")
    trace = analyse(hunt.trace(), hunt.snapshot)
    assert trace.first_failure.op == "aten.log"
    assert trace.first_failure.source.endswith(f"{__file__}:{_line('torch.log(picked)')}")
    assert "torch.log(picked)" in trace.first_failure.source_line
    assert trace.diagnosis.kind == "nan_op"
    clamp = next(r for r in trace.recommendations if r.type == "clamp")
    # a replay checks the culprit's call, not training: "checked", never "verified"
    assert clamp.check == "replay" and not clamp.verified, clamp.verification
    assert clamp.verification.startswith("checked by replaying the culprit: ")


def test_backward_op_is_traced_to_the_forward_line():
    model = nn.Sequential(nn.Linear(4, 4), RMS())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt) as hunt:
        with torch.no_grad():
            model[0].weight.zero_()
            model[0].bias.zero_()
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    f = hunt.first_failure
    assert (f.phase, f.module, f.tensor) == ("backward", "1", "grad_input[0]")
    trace = analyse(hunt.trace(), hunt.snapshot)
    assert trace.first_failure.op == "aten.div"
    assert "torch.sqrt(x.pow(2)" in trace.first_failure.source_line
    assert trace.first_failure.source.endswith(f":{_line('rms = torch.sqrt')}")


def _line(fragment: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if fragment in line and "_line(" not in line)


class Wide(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((8, 8), scale))

    def forward(self, x):
        return nn.functional.linear(x, self.weight) / 10


def _overflow_snapshot(scale: float):
    model = Wide(scale)
    with nanhunt.watch(model) as hunt, torch.autocast("cpu", dtype=torch.float16):
        model(torch.full((2, 8), 100.0))
    assert hunt.first_failure is not None
    return hunt


@pytest.mark.parametrize(("scale", "fits"), [(100.0, True), (1e4, False)])
def test_float32_verification_depends_on_the_replay(scale, fits):
    # 8 * 100 * 100 = 8e4 overflows fp16 inside the module; / 10 fits when kept in float32;
    # 8 * 100 * 1e4 / 10 = 8e5 overflows even when computed in float32 and cast back
    hunt = _overflow_snapshot(scale)
    snap = hunt.snapshot
    assert module.replay(snap).first.op == "aten.mm"
    r32 = module.replay(snap, "float32")
    assert r32.first is None and r32.outputs_finite
    assert (r32.output_amax <= 65504) is fits
    trace = analyse(hunt.trace(), snap)
    rec = next(r for r in trace.recommendations if r.type == "fp32_module")
    assert (rec.check == "replay") is fits, rec.verification
    assert not rec.verified
    assert rec.data["fp32_exceeds"] is not fits


def test_snapshot_round_trip_and_replay_output(tmp_path):
    hunt = _overflow_snapshot(100.0)
    path = tmp_path / "snapshot.pt"
    files.save_snapshot(hunt.snapshot, path)
    snap = files.load_snapshot(path)
    assert snap.name == "Wide" and snap.autocast == (True, torch.float16)
    result = module.replay(snap)
    out = io.StringIO()
    show.print_replay(snap, result, Console(file=out, width=100, color_system=None))
    text = out.getvalue()
    assert "▶ aten.mm" in text
    assert "first non-finite value: aten.mm (forward)" in text


def test_load_snapshot_errors(tmp_path):
    with pytest.raises(nanhunt.NanhuntError, match="no such snapshot"):
        files.load_snapshot(tmp_path / "missing.pt")
    bad = tmp_path / "bad.pt"
    torch.save({"format": "other"}, bad)
    with pytest.raises(nanhunt.NanhuntError, match="not a nanhunt snapshot"):
        files.load_snapshot(bad)


def test_stale_inputs_are_detected_not_trusted():
    class Inplace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            x.mul_(0)  # changes the captured input of fc after fc ran
            return y * float("inf")

    model = Inplace()
    with nanhunt.watch(model) as hunt:
        model(torch.ones(2, 4))
    assert hunt.first_failure.module == "Inplace"
    assert hunt.snapshot.stale_inputs == ["input[0]"]
    trace = analyse(hunt.trace(), hunt.snapshot)
    assert any("changed in place after capture" in n for n in trace.notes)
    assert all(not r.verified for r in trace.recommendations)


class Encoder(nn.Module):
    """A user's model around torch's own TransformerEncoder: no user frame runs inside it."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = self.encoder(x)  # the user's call into torch's code
        return self.head(h)


def _train_half(model: nn.Module, batch, big: float) -> nanhunt.Hunt:
    torch.manual_seed(0)
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanhunt.watch() as hunt:
        for step in range(3):
            x = (batch() * (1.0 if step < 2 else big)).half()
            out = model(x)  # the user's call of the whole model
            loss = out.float().sum() * 100.0
            opt.zero_grad()
            loss.backward()
            opt.step()
    return hunt


@pytest.mark.parametrize(("case", "phase"), [("encoder", "forward"), ("mlp", "backward")])
def test_the_source_line_is_always_the_users(case, phase):
    """A failure inside torch's TransformerEncoderLayer is named at the user's call of the
    encoder (not at the first line of torch's forward that mentions the submodule, its
    fast-path check); a backward failure in an nn.Sequential MLP at the user's call of the
    model (not at the launcher's frame outside the replay)."""
    if case == "encoder":
        hunt = _train_half(Encoder(), lambda: torch.rand(5, 2, 16) * 2 - 1, 60000.0)
        want = "h = self.encoder(x)  # the user's call into torch's code"
    else:
        mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        hunt = _train_half(mlp, lambda: torch.rand(64, 8), 300.0)
        want = "out = model(x)  # the user's call of the whole model"
    trace = analyse(hunt.trace(), hunt.snapshot)
    f = trace.first_failure
    assert (f.step, f.phase) == (2, phase)
    assert f.op is not None
    assert f.source == f"{__file__}:{_line(want)}", (f.module, f.source)
    assert f.source_line == want
    assert trace.ops and all(op.source == f"{f.source}  {want}" for op in trace.ops)


def test_memory_an_op_has_not_written_yet_is_no_ops_doing():
    """torch.empty hands out memory as it was: an inf left there by a freed tensor is no op's
    result (judging it made the replay name aten.empty_like, or not, from run to run)."""
    import math

    from nanhunt.replay.ops import OpRecorder, StepLocator

    seen = 0
    for _ in range(5):
        x = torch.full((4096,), math.inf)
        del x  # its block goes back to the allocator, infs and all
        with OpRecorder() as rec, StepLocator(0) as loc:
            y = torch.empty(4096)
            z = torch.empty_like(y)
        seen += int(torch.isinf(y).any() or torch.isinf(z).any())
        assert rec.first is None and loc.found() is None
    if not seen:
        pytest.skip("the allocator handed out fresh memory every time: nothing was tested")


def test_the_op_that_made_nan_from_a_row_masked_throughout_is_named_not_the_views_of_the_mask():
    """A float mask built with masked_fill(-inf) (a mask op: the weak candidate), carried on by
    unsqueeze and add (they make no new kind of non-finite value), then a softmax over a row
    whose every entry is -inf: the softmax made the NaN, from infinite inputs."""
    import math

    from nanhunt.replay.ops import OpRecorder

    scores = torch.randn(2, 4, 4)
    blocked = torch.zeros(4, 4, dtype=torch.bool)
    blocked[0, :] = True  # query 0 may attend to nothing
    with OpRecorder() as rec:
        mask = torch.zeros(4, 4).masked_fill(blocked, -math.inf).unsqueeze(0)
        probs = torch.softmax(scores + mask, dim=-1)
    assert torch.isnan(probs[:, 0]).all() and not torch.isnan(probs[:, 1:]).any()
    assert rec.first is not None and rec.first.op == "aten._softmax", rec.first
    assert rec.first.input_inf == 8  # the two samples' row 0, 4 keys each
    assert rec.weak is not None and rec.weak.op == "aten.masked_fill"
    # an op that only carried the -inf on is not where it was made
    carried = [o.op for o in rec.ops if o.nonfinite and not o.first_nonfinite]
    assert "aten.unsqueeze" in carried and "aten.add" in carried
