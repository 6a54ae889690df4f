"""`nanhunt report` and `nanhunt replay` on what `nanhunt diagnose` wrote, as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def prefetch(cli):
    """The run the tests read, in the session's shared pool (tests/integration/conftest.py;
    started when collection ends); --verify 0 (the helper's default): the report and the
    snapshot are the same without re-runs."""
    return cli.submit("diagnose", "--quiet", EXAMPLES / "sqrt_backward.py")


@pytest.fixture(scope="module")
def diagnosed(cli):
    res = prefetch(cli).result()
    assert res.code == 1, res.stderr
    return res.out


def test_report_renders_again_and_writes_html(run_cli, diagnosed, tmp_path):
    html = tmp_path / "again.html"
    res = run_cli("report", str(diagnosed / "report.json"), "--html", str(html))
    assert res.code == 0, res.stderr
    assert "PROBLEM" in res.stdout and "norm" in res.stdout
    assert html.read_text().lower().startswith("<!doctype html>")
    # a folder works too
    assert run_cli("report", str(diagnosed)).code == 0


def data_version(folder):
    """The schema version this nanhunt wrote (the one it reads)."""
    return json.loads((folder / "report.json").read_text())["schema_version"]


def test_report_refuses_other_schema_versions_and_corrupt_files(run_cli, diagnosed, tmp_path):
    data = json.loads((diagnosed / "report.json").read_text())
    data["schema_version"] = 99
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps(data))
    res = run_cli("report", str(newer))
    assert res.code == 2
    assert res.stderr.strip() == ("nanhunt: report schema version 99 is not supported (this "
                                  f"nanhunt reads version {data_version(diagnosed)})")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text((diagnosed / "report.json").read_text()[:500])
    res = run_cli("report", str(corrupt))
    assert res.code == 2
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_replay_prints_the_op_level_trace(run_cli, diagnosed):
    res = run_cli("replay", str(diagnosed / "snapshot.pt"))
    assert res.code == 0, res.stderr
    assert "replay of norm" in res.stdout
    assert "first non-finite value: aten.div (backward)" in res.stdout
    assert "sqrt_backward.py:" in res.stdout


def test_replay_in_float32(run_cli, diagnosed):
    res = run_cli("replay", str(diagnosed / "snapshot.pt"), "--dtype", "float32")
    assert res.code == 0, res.stderr
    assert "aten." in res.stdout


def test_replay_of_a_missing_file_is_a_usage_error(run_cli, tmp_path):
    res = run_cli("replay", str(tmp_path / "nope.pt"))
    assert res.code == 2
    assert res.stderr.startswith("nanhunt: no such snapshot")
