"""The precision audit from the framework callbacks (``NanhuntCallback(audit=...)``), on the
real Lightning and Hugging Face Trainer: the layer built to lose accuracy ranks first with a
checked fp32 advice, a clean model gets none, and training is bit for bit what it is without
nanhunt (the reference: the same example run with no callback at all).

On CPU Lightning turns ``16-mixed`` into ``bf16-mixed`` (the audit measures bfloat16 as the run
computed it) and the HF Trainer trains in float32 (the audit simulates float16).
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch

AUDIT = Path(__file__).resolve().parents[2] / "examples" / "audit"
CULPRIT = "body.2"  # Recenter: (x + 256) - 256


def _main(script: str, *args: str) -> dict:
    ns = runpy.run_path(str(AUDIT / script), run_name="example")
    return ns["main"](list(args))


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _runs(script: str, tmp: Path, extra: list[str]) -> dict:
    runs = {"plain": _main(script, *extra)}
    for name, opts in (("audited", []), ("clean", ["--clean"])):
        out = tmp / name
        runs[name] = _main(script, "--callback", str(out), *opts, *extra)
        runs[name]["report"] = _report(out)
    return runs


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    pytest.importorskip("lightning")
    return _runs("lightning_audit.py", tmp_path_factory.mktemp("lightning"), [])


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    tmp = tmp_path_factory.mktemp("hf")
    return _runs("hf_trainer_audit.py", tmp, ["--output-dir", str(tmp / "hf")])


@pytest.fixture(params=["lightning", "hf"])
def runs(request):
    return request.param, request.getfixturevalue(f"{request.param}_runs")


def _ranked(audit: dict) -> list[dict]:
    return sorted((x for x in audit["layers"] if x["rank"]), key=lambda x: x["rank"])


def test_training_is_bit_identical_with_the_audit(runs):
    _fw, r = runs
    plain, audited = r["plain"], r["audited"]
    assert audited["losses"] == plain["losses"]  # every loss, as Python floats
    assert plain["state"].keys() == audited["state"].keys()
    for k, v in plain["state"].items():  # weights, BatchNorm running stats, batch counter
        assert torch.equal(v, audited["state"][k]), k
    assert torch.equal(plain["rng"], audited["rng"])
    # the audit did measure (the comparison above is not of a run where it never ran)
    assert audited["report"]["precision"]["steps"] == 3


def test_the_culprit_ranks_first_with_checked_advice(runs):
    fw, r = runs
    rep = r["audited"]["report"]
    pr = rep["precision"]
    if fw == "lightning":  # measured: the replay reproduced the run's own bfloat16 output
        assert (pr["target"], pr["mode"], pr["reproduced"]) == ("bfloat16", "measured", True)
    else:
        assert (pr["target"], pr["mode"]) == ("float16", "simulated")
        assert "autocast" in pr["simulation"]
    ranked = _ranked(pr)
    assert ranked[0]["module"] == CULPRIT and ranked[0]["type"] == "Recenter"
    assert ranked[1]["sqnr_db"] - ranked[0]["sqnr_db"] >= 20
    assert [x["module"] for x in pr["layers"] if x["stands_out"]] == [CULPRIT]
    [rec] = [x for x in rep["recommendations"] if x["type"] == "fp32_module"]
    assert rec["data"]["modules"] == [CULPRIT] and rec["verified"], rec["verification"]
    assert rec["data"]["loss_error_after"] <= 0.5 * rec["data"]["loss_error_before"]
    # the callback's own report: the diagnosis is there too, and the names agree with it
    assert rep["steps"] and not rep["problem"]
    diagnosed = {x["module"] for x in rep["layers"]}
    audited = {x["module"] for x in pr["layers"] if x["type"] != "Dropout"}  # (aliased there)
    assert CULPRIT in diagnosed and audited <= diagnosed, audited - diagnosed


def test_a_clean_model_gets_no_fp32_advice(runs):
    _fw, r = runs
    rep = r["clean"]["report"]
    pr = rep["precision"]
    assert pr["steps"] == 3 and _ranked(pr)
    assert not any(x["stands_out"] for x in pr["layers"])
    assert not [x for x in rep["recommendations"] if x["type"] == "fp32_module"]


def test_bad_audit_option_is_one_clear_error():
    pytest.importorskip("lightning")
    from nanhunt.errors import NanhuntError
    from nanhunt.integrations.lightning import NanhuntCallback

    with pytest.raises(NanhuntError, match="unknown target format"):
        NanhuntCallback(audit="float64")
    with pytest.raises(NanhuntError, match="against float32"):
        NanhuntCallback(audit="float32")
    with pytest.raises(NanhuntError, match="audit_steps"):
        NanhuntCallback(audit=True, audit_steps=0)
