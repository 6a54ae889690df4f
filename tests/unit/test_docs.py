"""The runnable example in docs/api.md runs and prints what its comments say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from clirun import run_python

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _runnable_blocks(text: str) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [b for b in blocks if "import nanhunt" in b and "# " in b and "..." not in b]


@pytest.mark.parametrize("index", [0, 1, 2])  # watch(), audit(), sentinel()
def test_api_example_prints_what_it_promises(tmp_path, index):
    blocks = _runnable_blocks((DOCS / "api.md").read_text())
    assert len(blocks) == 3
    block = blocks[index]
    expected = [m.group(1).strip() for m in re.finditer(r"print\(.*\)\s+# (.*)", block)]
    script = tmp_path / "example.py"
    script.write_text(block)
    out = run_python(script, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == expected
