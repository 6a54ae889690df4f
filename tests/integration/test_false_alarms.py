"""Healthy models a user would really train stay quiet; the same models with a real planted
failure are still caught at the right origin (issue: no false alarms)."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# script, plant step, expected origin (step, phase, module, tensor), diagnosis kind
CASES = [
    ("healthy_gpt.py", 3, (3, "forward", "blocks.1.mlp.fc", "output"), "overflow"),
    ("healthy_transformer_padding.py", 3, (3, "forward", "pool", "output"), "nan_op"),
    ("healthy_mha_mask.py", 3, (3, "forward", "attn", "output[0]"), "nan_op"),
    ("healthy_ignore_index.py", 3, (3, "forward", "", "loss"), "nan_op"),
    ("healthy_scaler_warmup.py", 12, (12, "optimizer", "body.0", "body.0.weight"), "lr_too_high"),
    ("healthy_cnn_bn.py", 3, (3, "data", "model", "input[0]"), "bad_input"),
]


def prefetch(cli) -> dict:
    """Each case's healthy and planted runs, in the session's shared pool (tests/integration/
    conftest.py; started when collection ends); a run another file makes too is made once."""
    runs = {}
    for script, plant, _origin, _kind in CASES:
        runs[script] = cli.submit("diagnose", "--quiet", EXAMPLES / script)
        runs[script, plant] = cli.submit("diagnose", "--quiet", EXAMPLES / script, "--plant",
                                         str(plant))
    return runs


@pytest.fixture(scope="module")
def runs(cli) -> dict:
    return prefetch(cli)


@pytest.mark.parametrize(("script", "plant", "origin", "kind"), CASES,
                         ids=[c[0].removesuffix(".py") for c in CASES])
def test_healthy_model_stays_quiet_and_planted_failure_is_caught(runs, script, plant,
                                                                 origin, kind):
    healthy = runs[script].result()
    assert healthy.code == 0, healthy.stderr
    report = healthy.report
    assert report["first_failure"] is None
    assert report["problem"] is False
    assert report["diagnosis"] is None
    assert not [w for w in report["warnings"] if w["severity"] == "error"]

    planted = runs[script, plant].result()
    assert planted.code == 1, planted.stderr
    f = planted.report["first_failure"]
    assert (f["step"], f["phase"], f["module"], f["tensor"]) == origin
    assert planted.report["diagnosis"]["kind"] == kind


def test_masks_are_recorded_as_facts_not_failures(runs):
    res = runs["healthy_gpt.py"].result()  # the healthy run above
    assert res.code == 0
    assert any("-inf" in fact and "absorbed" in fact for fact in res.report["facts"])


def test_scaler_warmup_skips_are_facts(runs):
    res = runs["healthy_scaler_warmup.py"].result()  # the healthy run above
    assert res.code == 0
    steps = res.report["steps"]
    assert steps[0]["skipped"] is True and steps[-1]["skipped"] is False
    assert any("skipped the step" in fact for fact in res.report["facts"])


def test_allow_inf_pattern_silences_an_intentional_infinity(run_cli, tmp_path):
    script = tmp_path / "sentinel.py"
    script.write_text(
        "import torch\n"
        "from torch import nn\n"
        "class Pad(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.cat([x, torch.full_like(x[:, :1], float('inf'))], 1)\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.pad = Pad()\n"
        "    def forward(self, x):\n"
        "        return self.pad(x)\n"
        "net = Net()\n"
        "with torch.no_grad():\n"
        "    out = net(torch.ones(2, 3))\n"
    )
    assert run_cli("diagnose", "--quiet", str(script)).code == 1
    res = run_cli("diagnose", "--quiet", "--allow-inf", "*.pad", str(script))
    assert res.code == 0, res.stderr


def test_a_row_masked_throughout_is_named_and_the_mask_fix_trains(runs, tmp_path):
    """The planted off-by-one window masks every key of query 0: the replay names the softmax
    (not a view op that carried the mask's -inf on), the evidence says the row was -inf
    throughout, and the first advice is the mask's. Applied by hand to a copy (the mask filled
    with float16's lowest value instead of -inf, as the snippet says), the planted step
    trains; the script as it is prints nan there."""
    import subprocess
    import sys

    report = runs["healthy_mha_mask.py", 3].result().report
    assert report["first_failure"]["op"] in ("aten._softmax", "aten.softmax")
    assert any("-inf throughout" in e for e in report["diagnosis"]["evidence"])
    first = report["recommendations"][0]
    assert first["type"] == "fix_mask" and first["code_change"]
    assert "torch.finfo(scores.dtype).min" in first["snippet"]
    script = EXAMPLES / "healthy_mha_mask.py"
    copy = tmp_path / script.name
    copy.write_text(script.read_text().replace(
        "logits = model(x, mask)",
        "logits = model(x, torch.zeros(mask.shape).masked_fill(mask, "
        "torch.finfo(torch.float16).min))"))

    def losses(path):
        out = subprocess.run([sys.executable, str(path), "--plant", "3", "--steps", "5"],
                             capture_output=True, text=True, check=True).stdout
        return [line.split()[-1] for line in out.splitlines()]

    assert losses(script)[3] == "nan"
    assert "nan" not in losses(copy)
