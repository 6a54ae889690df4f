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
