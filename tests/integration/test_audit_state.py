"""Modules with state across calls see the audit's replays: BatchNorm in train mode, dropout,
a call counter the output depends on, a buffer and a plain tensor attribute updated in place in
forward, a growing list, a cached tensor, a coin flip from Python's ``random``
(examples/audit/stateful_modules.py). The audit must change none of the user's results or
state, and must measure the calls as they ran (from the state they started in): the reference
for both is the same script or model without nanhunt."""

from __future__ import annotations

import copy
import json
import random
import runpy
from pathlib import Path

import pytest
import torch
from clirun import run_nanhunt, run_python
from torch import nn

import nanhunt

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "audit" / "stateful_modules.py"


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("stateful")
    plain = run_python(SCRIPT, cwd=ROOT, timeout=300)  # one thread, as the audit's
    audited = run_nanhunt(["audit", "--quiet", "--out", str(out), str(SCRIPT)], ROOT,
                          timeout=300)
    return plain, audited, json.loads((out / "report.json").read_text())


def test_cli_leaves_losses_parameters_buffers_state_and_rng_alone(cli_runs):
    plain, audited, report = cli_runs
    # every loss bit for bit, and a digest of every parameter, buffer, the counter, the
    # in-place tensor attribute, the list, the cache, torch's and Python's generators
    assert "state " in plain.stdout and plain.returncode == 0
    assert audited.stdout == plain.stdout, audited.stderr
    assert report["precision"]["steps"] == 3


def test_cli_replays_each_call_from_the_state_it_started_in(cli_runs):
    _plain, audited, report = cli_runs
    pr = report["precision"]
    # the target replay reproduces the run bit for bit (counter, buffer and coin included) ...
    assert pr["mode"] == "measured" and pr["reproduced"] is True
    # ... and no module "loses" accuracy because its replay alone saw a later state
    assert not any(x["stands_out"] for x in pr["layers"])
    assert report["recommendations"] == [] and audited.returncode == 0


def _example() -> dict:
    return runpy.run_path(str(SCRIPT), run_name="example")


def _train(model: nn.Module, steps: int, arch: str) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 3, 8, 8) if arch == "cnn" else torch.randn(8, 16)
        y = torch.randint(0, 4, (8,))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_library_leaves_the_model_and_the_generators_as_they_were(arch):
    ns = _example()
    torch.manual_seed(0)
    random.seed(0)
    model = ns["build"](arch)
    twin = copy.deepcopy(model)
    before = ns["digest"](model)
    shape = (8, 3, 8, 8) if arch == "cnn" else (8, 16)
    batches = lambda: (torch.randn(*shape), torch.randint(0, 4, (8,)))  # noqa: E731
    loss_fn = lambda out, y: nn.functional.cross_entropy(out.float(), y)  # noqa: E731
    trace = nanhunt.audit(model, batches, loss_fn, steps=2)
    # parameters, buffers, counter, list, cache, tensor attribute, torch's and Python's RNG
    assert ns["digest"](model) == before
    assert all(p.grad is None for p in model.parameters())
    pr = trace.precision
    assert pr.steps == 2 and pr.mode == "simulated"
    assert not any(x.stands_out for x in pr.layers) and not trace.recommendations
    # and training afterwards is what it is without the audit (same generator draws)
    rng = torch.get_rng_state(), random.getstate()
    with_audit = _train(model, 3, arch)
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    without = _train(twin, 3, arch)
    assert with_audit == without
    for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
