"""benchmarks/overhead.py runs end to end and writes its JSON (no assertions on timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clirun import run_python

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "overhead.py"


@pytest.mark.slow  # (about 15 s of the default suite's time: run with -m slow)
def test_overhead_quick_writes_every_variant(tmp_path):
    out = tmp_path / "overhead.json"
    proc = run_python(SCRIPT, "--quick", "--models", "mlp", "--precisions", "fp32", "--steps",
                      "2", "--repeats", "1", "--json", str(out), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == 1
    assert doc["machine"]["torch_version"]
    rows = {r["variant"]: r for r in doc["results"]}
    assert set(rows) == {
        "plain", "nanhunt", "nanhunt-sampled", "sentinel", "detect_anomaly", "naive"}
    for row in rows.values():
        assert row["model"] == "mlp"
        assert row["precision"] == "fp32"
        assert row["median_ms"] > 0
        assert row["n_steps"] == 2
        assert row["failures"] == 0
    assert doc["memory"][0]["nanhunt_host_peak_bytes"] > 0
    assert [r["steps"] for r in doc["growth"]["runs"]] == [5, 10]
