"""The fixes for failures without a NaN (zloss, cap, warmup): installed from outside, each
against a reference the test computes itself (numpy float64 for the z term, the parameter
change of plain SGD for the lr each step used, a hand schedule), and against its snippet pasted
into a copy of a training script (tests/scripts/curves_common.py)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_fixes import paste, run_script
from torch import nn

import nanhunt
from nanhunt.errors import NanhuntError
from nanhunt.experiment.curve_fixes import soft_cap
from nanhunt.experiment.fixes import FixMismatch, install
from nanhunt.fixspec import SnippetContext, parse_fix, snippet

SCRIPTS = Path(__file__).resolve().parents[2] / "tests" / "scripts"


def _copy_with(tmp_path: Path, spec: str, **where: str) -> Path:
    """curves_gpt.py beside a copy of curves_common.py with ``spec``'s snippet pasted."""
    snip = snippet([parse_fix(spec)], SnippetContext(device="cpu", optimizer="opt"))
    # (the copy's imports go first: no __future__ line, which would have to precede them)
    common = (SCRIPTS / "curves_common.py").read_text().replace(
        "from __future__ import annotations\n", "")
    (tmp_path / "curves_common.py").write_text(paste(common, snip.code, helper=snip.helper,
                                                     **where))
    shutil.copy(SCRIPTS / "curves_gpt.py", tmp_path / "curves_gpt.py")
    return tmp_path / "curves_gpt.py"


def _run(path: Path, args: list[str], fixes: list[str] = ()) -> list[float]:
    import sys

    sys.path.insert(0, str(path.parent))
    sys.modules.pop("curves_common", None)  # the copy's, not the original's
    try:
        return [float(line.split()[-1]) for line in run_script(path, args, fixes)
                if line.startswith("step ")]
    finally:
        sys.path.remove(str(path.parent))
        sys.modules.pop("curves_common", None)


# ----------------------------------------------------------------------------- zloss


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def test_zloss_adds_the_hand_computed_term_to_the_scripts_loss():
    model = _Head()
    x, y = torch.randn(7, 3, 6), torch.randint(0, 5, (21,))
    coef = 0.01
    with install([parse_fix(f"zloss:head={coef}")]):
        logits = model(x)
        loss = nn.CrossEntropyLoss()(logits.reshape(-1, 5), y)  # the module calls F's
        loss.backward()
    fixed_grads = [p.grad.clone() for p in model.parameters()]
    # the reference: cross-entropy and z term in numpy float64 from the same logits
    z = logits.detach().double().numpy()
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    ce = float(np.mean(lse.reshape(-1) - z.reshape(-1, 5)[np.arange(21), y.numpy()]))
    assert float(loss.detach()) == pytest.approx(ce + coef * float(np.mean(lse ** 2)), rel=1e-6)
    # and the gradients are those of the loss with the term written by hand
    model.zero_grad()
    out = model(x)
    (F.cross_entropy(out.reshape(-1, 5), y)
     + coef * out.float().logsumexp(-1).pow(2).mean()).backward()
    for a, p in zip(fixed_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad)
    # outside the fix, the loss is the script's own again
    with torch.no_grad():
        assert float(F.cross_entropy(model(x).reshape(-1, 5), y)) == pytest.approx(ce, rel=1e-6)


def test_zloss_leaves_a_forward_without_autograd_alone():
    model = _Head()
    x, y = torch.randn(4, 6), torch.randint(0, 5, (4,))
    with install([parse_fix("zloss:head=1")]), torch.no_grad():
        assert torch.equal(F.cross_entropy(model(x), y), F.cross_entropy(model(x), y))


def test_zloss_on_the_script_equals_its_snippet_pasted(tmp_path):
    args = ["--steps", "5", "--lr", "0.01"]
    copy = _copy_with(tmp_path, "zloss:lm_head=0.001",
                      after="loss = F.cross_entropy(logits, y.reshape(-1))")
    by_hand = _run(copy, args)
    installed = _run(SCRIPTS / "curves_gpt.py", args, ["zloss:lm_head=0.001"])
    plain = _run(SCRIPTS / "curves_gpt.py", args)
    assert installed == by_hand
    # the script's own --z-loss flag is the same change written by its author
    assert installed == _run(SCRIPTS / "curves_gpt.py", [*args, "--z-loss", "0.001"])
    assert installed[0] > plain[0]  # the term is in the loss the script prints


def test_zloss_with_a_loss_written_by_hand_stops_with_one_line():
    model = _Head()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(FixMismatch, match=r"reached no F\.cross_entropy"), \
            install([parse_fix("zloss:head=0.1")]) as fixes:
        out = model(torch.randn(4, 6))
        (-(out.log_softmax(-1)[:, 0]).mean()).backward()
        opt.step()
        fixes.step_ended(True)


# ----------------------------------------------------------------------------- cap


def test_soft_cap_bounds_logits_and_keeps_masks():
    x = torch.tensor([0.0, 1.0, -3.0, 1e4, float("-inf"), torch.finfo(torch.float32).min])
    y = soft_cap(x, 10.0)
    ref = 10 * np.tanh(np.array([0.0, 1.0, -3.0, 1e4]) / 10)
    np.testing.assert_allclose(y[:4].numpy(), ref, rtol=1e-6)
    assert y[4] == float("-inf") and y[5] == torch.finfo(torch.float32).min


def test_cap_on_the_script_equals_its_snippet_pasted(tmp_path):
    args = ["--steps", "6", "--hot", "qkv", "--hot-lr", "1"]
    spec = "cap:trunk.blocks.*.attn=5"
    copy = _copy_with(tmp_path, spec, after="att = (q @ k.transpose(-2, -1))")
    installed = _run(SCRIPTS / "curves_gpt.py", args, [spec])
    assert installed == _run(copy, args)
    assert installed != _run(SCRIPTS / "curves_gpt.py", args)


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qk = nn.Linear(4, 8)

    def forward(self, x):
        q, k = self.qk(x).split(4, dim=-1)
        return F.softmax(q @ k.transpose(-2, -1) * 50, dim=-1) @ x


def test_a_report_sees_the_capped_logits():
    model = nn.Sequential(_Attn(), nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 5, 4) * 3
    with torch.no_grad():
        ref = model[0].qk(x).split(4, dim=-1)
    raw = float((ref[0] @ ref[1].transpose(-2, -1) * 50).abs().max())
    with install([parse_fix("cap:0=7")]), nanhunt.watch(model, opt) as h:
        F.cross_entropy(model(x).reshape(-1, 3), torch.zeros(10, dtype=torch.long)).backward()
        opt.step()
    layer = next(lay for lay in h.trace().layers if lay.module == "0")
    assert raw > 7
    assert max(layer.logit_amax_by_step.values()) == pytest.approx(
        7 * math.tanh(raw / 7), rel=1e-5)


def test_a_cap_on_a_module_without_softmax_says_so():
    model = _Head()
    with pytest.raises(FixMismatch, match="called no softmax"), \
            install([parse_fix("cap:head=5")]) as fixes:
        model(torch.randn(2, 6)).sum().backward()
        fixes.step_ended(True)


# ----------------------------------------------------------------------------- warmup


@pytest.mark.parametrize("schedule", ["cosine", "absolute"])
def test_warmup_scales_the_lr_the_script_set_at_every_step(schedule):
    """SGD without momentum moves a weight by lr x grad: the lr each step used, measured from
    the parameters, is the script's own schedule times min(1, (k+1)/N)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([w], lr=0.5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6) \
        if schedule == "cosine" else None
    n, used, script = 4, [], []
    with install([parse_fix(f"warmup={n}")]):
        for k in range(8):
            if sched is None:
                opt.param_groups[0]["lr"] = 0.5 / (k + 1)  # absolute values, set by hand
            script.append(opt.param_groups[0]["lr"])
            opt.zero_grad()
            (w * torch.arange(1.0, 4.0)).sum().backward()
            before = w.detach().clone()
            opt.step()
            used.append(float(((before - w.detach()) / w.grad).mean()))
            assert opt.param_groups[0]["lr"] == script[-1]  # the script sees its own value
            if sched is not None:
                sched.step()
    hand = [lr * min(1.0, (k + 1) / n) for k, lr in enumerate(script)]
    np.testing.assert_allclose(used, hand, rtol=1e-5)
    if sched is not None:  # the script's own schedule ran as without the fix
        ref = torch.optim.lr_scheduler.CosineAnnealingLR(
            torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5), T_max=6)
        expect = []
        for _ in range(8):
            expect.append(ref.get_last_lr()[0])
            ref.optimizer.step()
            ref.step()
        np.testing.assert_allclose(script, expect, rtol=1e-12)


def test_warmup_on_the_script_equals_its_snippet_pasted(tmp_path):
    args = ["--steps", "6", "--restarts", "4", "--lr", "0.01"]
    copy = _copy_with(tmp_path, "warmup=5", after="opt = torch.optim.Adam(groups, lr=args.lr)")
    installed = _run(SCRIPTS / "curves_gpt.py", args, ["warmup=5"])
    assert installed == _run(copy, args)
    assert installed != _run(SCRIPTS / "curves_gpt.py", args)


@pytest.mark.parametrize(("text", "canon"), [
    ("zloss:lm_head=1e-4", "zloss:lm_head=0.0001"),
    ("cap:blocks.*.attn=30", "cap:blocks.*.attn=30"),
    ("warmup=2000", "warmup=2000"),
])
def test_curve_specs_round_trip(text, canon):
    assert str(parse_fix(text)) == canon
    assert str(parse_fix(canon)) == canon


@pytest.mark.parametrize("text", ["warmup=2.5", "warmup=0", "zloss:=1", "cap:attn"])
def test_bad_curve_specs_are_one_line_errors(text):
    with pytest.raises(NanhuntError):
        parse_fix(text)
