"""The real-code corpus (benchmarks/realworld): its checks, and its fast subset when present.

The corpus's scripts are public code that this repository does not commit
(benchmarks/realworld/README.md): the subset runs where ``sources/`` holds them, and says why
it did not otherwise. The comparisons the runner judges nanhunt by are tested here on their
own, always: a runner that cannot see a one-bit difference would pass anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "benchmarks" / "realworld" / "run.py"


@pytest.fixture(scope="module")
def rw():
    spec = importlib.util.spec_from_file_location("realworld_run", RUNNER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _result(rw, tmp_path, out="", err=""):
    return rw.RunResult(0, out, err, 0.0, tmp_path)


def test_checkpoints_differing_in_one_bit_differ(rw, tmp_path):
    state = {"model": {"w": torch.linspace(-1, 1, 7)}, "iter": 3, "opt": [torch.ones(2)]}
    torch.save(state, tmp_path / "a.pt")
    torch.save(state, tmp_path / "b.pt")
    flipped = state["model"]["w"].clone()
    flipped.view(torch.int32)[3] ^= 1  # the last mantissa bit of one value
    torch.save({**state, "model": {"w": flipped}}, tmp_path / "c.pt")
    assert rw._same_file(tmp_path / "a.pt", tmp_path / "b.pt") is None
    assert "model.w: values" in rw._same_file(tmp_path / "a.pt", tmp_path / "c.pt")
    # NaN against NaN with the same bits is the same checkpoint; -0.0 against 0.0 is not
    assert rw._tensor_diff(torch.tensor([float("nan")]), torch.tensor([float("nan")]), "") is None
    assert rw._tensor_diff(torch.tensor([0.0]), torch.tensor([-0.0]), "x") == "x: values"


def test_outputs_compare_after_masking_only_timings(rw, tmp_path):
    entry = next(e for e in rw.ENTRIES if e.name == "nanogpt")
    plain = _result(rw, tmp_path, "iter 0: loss 3.2211, time 58.39ms, mfu -100.00%\niter 1: x\n")
    same = _result(rw, tmp_path, "iter 0: loss 3.2211, time 12.00ms, mfu -100.00%\niter 1: x\n")
    other = _result(rw, tmp_path, "iter 0: loss 3.2212, time 58.39ms, mfu -100.00%\niter 1: x\n")
    cut = _result(rw, tmp_path, "iter 0: loss 3.2211, time 1.00ms, mfu -100.00%\n")
    assert rw.same_output(entry, plain, same, prefix=False) is None
    assert "line 1" in rw.same_output(entry, plain, other, prefix=False)
    assert rw.same_output(entry, plain, cut, prefix=True) is None
    assert "line 2" in rw.same_output(entry, plain, cut, prefix=False)
    noted = _result(rw, tmp_path, plain.stdout, "nanhunt: a note of its own\n")
    assert rw.same_output(entry, plain, noted, prefix=False) is None


def test_a_nanhunt_block_after_the_scripts_stderr_is_not_the_scripts(rw, tmp_path):
    entry = next(e for e in rw.ENTRIES if e.name == "lightning_classifier")
    plain = _result(rw, tmp_path, "out\n", "warning: a\nwarning: b\n")
    panel = "nanhunt: the training callback's summary (reports in r)\n| OK |\n+----+\n"
    after = _result(rw, tmp_path, "out\n", plain.stderr + panel)
    inside = _result(rw, tmp_path, "out\n", "warning: a\n" + panel + "warning: b\n")
    on_stdout = _result(rw, tmp_path, "out\n" + panel, plain.stderr)
    assert rw.same_output(entry, plain, after, prefix=False) is None
    assert "stderr differs" in rw.same_output(entry, plain, inside, prefix=False)
    assert "stdout differs" in rw.same_output(entry, plain, on_stdout, prefix=False)


def test_an_entry_runs_only_from_its_pinned_files(rw, tmp_path, monkeypatch):
    entry = next(e for e in rw.ENTRIES if e.name == "mnist")
    monkeypatch.setattr(rw, "SOURCES", tmp_path)
    assert rw.verify_sources(entry).startswith("missing")
    (tmp_path / "mnist").mkdir()
    for rel in entry.files:
        (tmp_path / "mnist" / rel).write_text("edited\n")
    assert "differs from pytorch/examples@" in rw.verify_sources(entry)


def test_the_fast_subset_holds_every_check(tmp_path):
    spec = importlib.util.spec_from_file_location("realworld_fast", RUNNER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        missing = {e.name: module.verify_sources(e) for e in module.ENTRIES if e.fast}
    finally:
        sys.modules.pop(spec.name, None)
    absent = {k: v for k, v in missing.items() if v}
    if absent:
        pytest.skip(f"corpus sources not present (benchmarks/realworld/README.md): {absent}")
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(RUNNER), "--fast", "--json", str(out),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    results = json.loads(out.read_text())
    failed = [c for c in results["checks"] if not c["ok"]]
    assert proc.returncode == 0 and not failed and results["total"] >= 8, proc.stdout[-3000:]
