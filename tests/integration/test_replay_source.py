"""The op table's source column, in `nanhunt replay` and in the HTML report, is never empty when
the culprit is one of torch's own modules (nn.Linear, nn.Conv2d): it names the user's line that
called the module, since no user frame runs inside it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
from clirun import run_nanhunt

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# a CNN sibling of ffn_overflow.py: a float16 Conv2d whose output overflows
CNN = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            h = self.conv(x)  # the call site the report must name
            return self.head(h.mean((2, 3)))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        x = torch.randn(2, 3, 8, 8) * (1.0 if step < 2 else 3e3)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
""")

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _diagnose(tmp: Path, name: str) -> tuple[Path, Path, str, subprocess.CompletedProcess]:
    if name == "cnn":
        script = tmp / "cnn_overflow.py"
        script.write_text(CNN)
        call = "h = self.conv(x)"
    else:
        script = EXAMPLES / name
        call = "self.wo(self.act(self.wi(x)))"
    out = tmp / "report"
    # --verify 0: the op table and its source column are the same with or without re-runs
    proc = run_nanhunt(["diagnose", "--quiet", "--verify", "0", "--out", str(out), str(script)],
                       tmp, env=ENV, timeout=300)
    return out, script, call, proc


def prefetch(cli) -> dict:
    """Both runs, in the session's shared pool (tests/integration/conftest.py; started when
    collection ends)."""
    return {name: cli.call(("replay-source", name), lambda cwd, n=name: _diagnose(cwd, n))
            for name in ("ffn_overflow.py", "cnn")}


@pytest.fixture(scope="module", params=["ffn_overflow.py", "cnn"])
def diagnosed(request, cli):
    out, script, call, proc = prefetch(cli)[request.param].result()
    assert proc.returncode == 1, proc.stderr
    return out, script, call


def test_every_replayed_op_names_the_users_line(diagnosed):
    out, script, call = diagnosed
    report = json.loads((out / "report.json").read_text())
    assert report["ops"]
    assert report["first_failure"]["module"] in ("conv", "encoder.blocks.1.ffn.wo")
    for op in report["ops"]:
        assert op["source"], op
        assert op["source"].startswith(f"{script}:") and call in op["source"], op


def test_the_html_op_table_has_its_source_column(diagnosed):
    out, script, _call = diagnosed
    html = (out / "report.html").read_text()
    cells = re.findall(r'<td class="mono muted">([^<]*)</td></tr>', html)
    assert cells and all(script.name in c for c in cells), cells


def test_nanhunt_replay_shows_the_source(diagnosed):
    out, script, _call = diagnosed
    proc = run_nanhunt(["replay", str(out / "snapshot.pt"), "--script", str(script)],
                       out.parent, env=dict(ENV, COLUMNS="200"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if "aten." in ln and "│" in ln]
    assert rows
    for row in rows:
        assert f"{script.name}:" in row.split("│")[-1], row
