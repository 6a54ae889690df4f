"""torch.compile under ``nanhunt diagnose`` (tests/scripts/compiled_mlp.py): the compiled run is
the plain compiled run, bit for bit; a failure inside a compiled module is named by an eager
replay; a NaN that only the compiled code makes is reported as such.

The inductor run compiles C++ kernels (gcc): the plain run pays the compile, nanhunt's run then
finds the same graphs in inductor's cache, which it can only do if it traced the same graph.
The other two use cheap backends (the eager replay does not depend on the backend)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compiled_mlp.py"
TIMEOUT = 400

HEALTHY = ("--backend", "inductor", "--save", "{cwd}/params.pt")
PLANTED = ("--backend", "aot_eager", "--plant")
BROKEN = ("--backend", "broken")


def _nanhunt(cli, args):
    return cli.submit_with_files({}, "diagnose", "--quiet", SCRIPT, *args, timeout=TIMEOUT)


def _python(cli, args):
    # through the fork server, as nanhunt's runs (no second torch import to pay)
    return cli.python_with_files({}, SCRIPT, *args, timeout=TIMEOUT)


# (sampled mode's leak, the with_kwargs flag torch's handle left, is a unit test:
# tests/unit/test_capture.py::test_a_removed_global_forward_hook_takes_its_with_kwargs_flag)
QUIET_MODES = [("diagnose", "--mode", "sentinel"), ("audit",)]


def _in_mode(cli, mode):
    return cli.submit_with_files({}, *mode[:1], "--quiet", *mode[1:], SCRIPT, "--backend",
                                 "aot_eager", timeout=TIMEOUT)


def prefetch(cli) -> None:
    # (not the inductor pair: only the slow test reads it, and gcc's compile is most of the cost)
    _nanhunt(cli, PLANTED)
    _nanhunt(cli, BROKEN)
    _python(cli, ("--backend", "aot_eager"))
    for mode in QUIET_MODES:
        _in_mode(cli, mode)


@pytest.mark.slow
def test_a_compiled_model_trains_bit_identically_and_quietly(cli):
    plain = _python(cli, HEALTHY).result()  # first: it pays inductor's compile
    run = _nanhunt(cli, HEALTHY).result()
    assert plain.code == 0, plain.stderr
    assert run.code == 0, run.stderr
    assert run.stdout == plain.stdout  # every loss, every digit
    assert len(plain.stdout.splitlines()) == 5
    assert run.stderr == plain.stderr == ""  # no torch warning about global hooks
    ours = torch.load(run.cwd / "params.pt")
    theirs = torch.load(plain.cwd / "params.pt")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    report = run.report
    assert report["first_failure"] is None
    assert any("seen only at the boundary: cm" in n for n in report["notes"]), report["notes"]


def test_an_overflow_inside_a_compiled_module_names_the_layer(cli):
    run = _nanhunt(cli, PLANTED).result()
    assert run.code == 1, run.stderr
    ff = run.report["first_failure"]
    # the first Linear inside `cm` overflows float16 on the 1e5-scaled batch
    assert (ff["step"], ff["phase"], ff["module"]) == (3, "forward", "0")
    assert "inside the compiled module cm" in ff["detail"].lower()
    assert ff["inputs"][0]["amax"] > 65504  # the batch reaching it, beyond float16's max
    assert ff["stats"]["posinf"] + ff["stats"]["neginf"] > 0
    assert run.report["diagnosis"]["kind"] == "bad_input"
    assert "UserWarning" not in run.stderr


def test_a_nan_only_the_compiled_code_makes_is_reported_as_such(cli):
    run = _nanhunt(cli, BROKEN).result()
    assert run.code == 1, run.stderr
    report = run.report
    ff = report["first_failure"]
    assert (ff["step"], ff["phase"], ff["module"]) == (3, "forward", "cm")
    assert "original code stays finite" in ff["detail"]
    assert "compiler-only nan" in ff["detail"].lower()
    assert "emulate_precision_casts" in ff["detail"] and "TORCH_BISECT" in ff["detail"]
    assert report["diagnosis"]["evidence"][0].startswith("cm is compiled")


@pytest.mark.parametrize("mode", QUIET_MODES, ids=["sentinel", "audit"])
def test_the_sentinel_and_audit_modes_leave_a_compiled_run_as_plain(cli, mode):
    """torch warns into stderr at every compiled call while any global module hook exists, and
    a removed with_kwargs hook used to leave its flag behind: these modes printed it (the
    audit's replays also re-compiled the module, with Dynamo's logs)."""
    plain = _python(cli, ("--backend", "aot_eager")).result()
    run = _in_mode(cli, mode).result()
    assert plain.code == 0 and run.code == 0, run.stderr
    assert run.stdout == plain.stdout
    assert run.stderr == plain.stderr == ""
    if mode == ("audit",):  # the layers inside the compiled module, by an eager replay
        report = json.loads((run.cwd / "nanhunt-audit" / "report.json").read_text())
        layers = {r["module"] for r in report["precision"]["layers"]}
        assert {"0", "2"} <= layers, layers
