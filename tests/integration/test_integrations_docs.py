"""Every runnable example in docs/integrations.md runs and prints what its comments say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
BLOCKS = list(re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S))
NEEDS = {0: "lightning", 1: "transformers", 2: "tensorboard"}


def test_the_doc_has_one_example_each():
    assert len(BLOCKS) == 3
    assert "nanhunt.integrations.lightning" in BLOCKS[0]
    assert "nanhunt.integrations.transformers" in BLOCKS[1]
    assert "export_tensorboard" in BLOCKS[2]


@pytest.mark.parametrize("index", sorted(NEEDS), ids=lambda i: NEEDS[i])
def test_example_prints_what_it_promises(index, tmp_path):
    pytest.importorskip(NEEDS[index])
    block = BLOCKS[index]
    expected = [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s+# (.*)$", block,
                                                         flags=re.M)]
    assert expected
    script = tmp_path / "example.py"
    script.write_text(block)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-len(expected):] == expected, out.stdout
    if index < 2:  # the callbacks wrote the full report where they were told to
        assert {p.name for p in (tmp_path / "nanhunt-report").iterdir()} >= {
            "report.json", "report.html", "report.txt"}
