"""Every runnable example in docs/integrations.md runs and prints what its comments say."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
from clirun import run_python

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
BLOCKS = list(re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S))
NEEDS = {0: "lightning", 1: "transformers", 2: "tensorboard"}


def test_the_doc_has_one_example_each():
    assert len(BLOCKS) == 3
    assert "nanhunt.integrations.lightning" in BLOCKS[0]
    assert "nanhunt.integrations.transformers" in BLOCKS[1]
    assert "export_tensorboard" in BLOCKS[2]


def _run(cwd: Path, index: int) -> tuple[Path, subprocess.CompletedProcess]:
    script = cwd / "example.py"
    script.write_text(BLOCKS[index])
    return cwd, run_python(script, cwd=cwd, timeout=300)  # as python runs it, forked


def prefetch(cli) -> dict:
    """Each example whose package is installed, in the session's shared pool
    (tests/integration/conftest.py; started when collection ends), in a fresh folder."""
    return {i: cli.call(("integrations-doc", i), lambda cwd, i=i: _run(cwd, i))
            for i in sorted(NEEDS) if i < len(BLOCKS) and importlib.util.find_spec(NEEDS[i])}


@pytest.mark.parametrize("index", sorted(NEEDS), ids=lambda i: NEEDS[i])
def test_example_prints_what_it_promises(cli, index):
    pytest.importorskip(NEEDS[index])
    block = BLOCKS[index]
    expected = [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s+# (.*)$", block,
                                                         flags=re.M)]
    assert expected
    tmp_path, out = prefetch(cli)[index].result()
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-len(expected):] == expected, out.stdout
    if index < 2:  # the callbacks wrote the full report where they were told to
        assert {p.name for p in (tmp_path / "nanhunt-report").iterdir()} >= {
            "report.json", "report.html", "report.txt"}
