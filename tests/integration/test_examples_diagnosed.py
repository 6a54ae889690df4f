"""`nanhunt diagnose` on each failing example: the right diagnosis, evidence and verified
recommendation; and the recommended snippet, pasted into the script, makes it train finitely."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# script: (step, phase, module, tensor, kind, op, source fragment, recommendation verified)
EXPECTED = {
    "ffn_overflow.py": (3, "forward", "encoder.blocks.1.ffn.wo", "output", "overflow",
                        "aten.addmm", "self.wo(", "fp32_module"),
    "log_zero_loss.py": (4, "forward", "criterion", "output", "nan_op", "aten.log",
                         "torch.log(", "clamp"),
    "sqrt_backward.py": (2, "backward", "norm", "grad_input[0]", "nan_op", "aten.div",
                         "torch.sqrt(", "clamp"),
    # the collapse is where the capture saw it (loss_scaling); the diagnosis is the op that
    # causes it, in backward
    "scale_collapse.py": (0, "backward", "pdist", "grad_input[0]", "nan_op", "aten.div",
                          "torch.sqrt(", "clamp"),
    "nan_batch.py": (3, "data", "model", "input[0]", "bad_input", None, None, None),
    "high_lr.py": (2, "optimizer", "head", "head.weight", "lr_too_high", None, None, None),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return {}


def _diagnose(run_cli, reports, script):
    if script not in reports:
        res = run_cli("diagnose", "--quiet", str(EXAMPLES / script), verify=True)
        assert res.code == 1, res.stderr
        reports[script] = res.report
    return reports[script]


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_is_diagnosed(run_cli, reports, script):
    step, phase, module, tensor, kind, op, fragment, verified_type = EXPECTED[script]
    report = _diagnose(run_cli, reports, script)
    f = report["first_failure"]
    assert (f["step"], f["phase"], f["module"], f["tensor"]) == (step, phase, module, tensor)
    assert report["diagnosis"]["kind"] == kind
    assert report["diagnosis"]["evidence"]
    if script == "scale_collapse.py":
        assert report["diagnosis"]["phase"] == "backward"
    if op:
        assert f["op"] == op
        assert fragment in f["source_line"]
    if verified_type:
        rec = next(r for r in report["recommendations"] if r["type"] == verified_type)
        assert rec["verified"], rec["verification"]
    for rec in report["recommendations"]:
        compile(rec["snippet"], rec["type"], "exec")  # every snippet is valid Python
        assert rec["verification"]


def test_grad_underflow_is_a_problem_with_an_init_scale(run_cli):
    res = run_cli("diagnose", "--quiet", str(EXAMPLES / "grad_underflow.py"))
    assert res.code == 1
    report = res.report
    assert report["first_failure"] is None
    assert report["diagnosis"]["kind"] == "underflow"
    rec = next(r for r in report["recommendations"] if r["type"] == "init_scale")
    assert rec["value"] >= 2.0**16


def _paste_after(source: str, anchor: str, snippet: str) -> str:
    """Paste a snippet as a user would: its imports at the top, the rest after ``anchor``."""
    imports = [ln for ln in snippet.splitlines() if ln.startswith(("import ", "from "))]
    body = "\n".join(ln for ln in snippet.splitlines() if ln not in imports)
    lines = source.splitlines()
    i = next(i for i, line in enumerate(lines) if anchor in line)
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    block = textwrap.indent(body, indent).splitlines()
    first_import = next(j for j, line in enumerate(lines) if line.startswith(("import ", "from ")))
    lines = lines[: i + 1] + block + lines[i + 1:]
    return "\n".join(lines[:first_import] + imports + lines[first_import:]) + "\n"


def _apply_line_edit(source: str, snippet: str) -> str:
    """A floor snippet names the line (``# file.py:27: <line>``) and ends with its edit."""
    lines = snippet.splitlines()
    original, edited = lines[0].split(": ", 1)[1].strip(), lines[-1].strip()
    out = []
    for line in source.splitlines():
        if line.strip() == original:
            line = line[: len(line) - len(line.lstrip())] + edited
        out.append(line)
    assert out != source.splitlines(), original
    return "\n".join(out) + "\n"


@pytest.mark.parametrize(("script", "rec_type", "anchor"), [
    ("ffn_overflow.py", "fp32_module", "optimizer = "),
    ("log_zero_loss.py", "clamp", "optimizer = "),
    ("high_lr.py", "lower_lr", "optimizer = "),
])
def test_applying_the_snippet_makes_the_run_finite(run_cli, reports, tmp_path, script, rec_type,
                                                   anchor):
    report = _diagnose(run_cli, reports, script)
    rec = next(r for r in report["recommendations"] if r["type"] == rec_type)
    fixed = tmp_path / script
    source = (EXAMPLES / script).read_text()
    if rec["snippet"].startswith("# ") and rec["fix"][0].startswith("floor:"):
        fixed.write_text(_apply_line_edit(source, rec["snippet"]))  # an edit of one line
    else:
        fixed.write_text(_paste_after(source, anchor, rec["helper"] + "\n" + rec["snippet"]))
    res = run_cli("diagnose", "--quiet", str(fixed))
    assert res.code == 0, (res.stderr, fixed.read_text())
    assert res.report["first_failure"] is None
    assert all(s["loss"] is not None for s in res.report["steps"])


def test_applying_the_sqrt_floor_fixes_the_backward_nan(run_cli, reports, tmp_path):
    report = _diagnose(run_cli, reports, "sqrt_backward.py")
    rec = next(r for r in report["recommendations"] if r["type"] == "clamp")
    floor = rec["data"]["min"]
    source = (EXAMPLES / "sqrt_backward.py").read_text()
    old = "torch.sqrt(x.pow(2).mean(-1, keepdim=True))"
    assert old in source
    fixed = tmp_path / "sqrt_backward.py"
    fixed.write_text(source.replace(
        old, f"torch.sqrt(x.pow(2).mean(-1, keepdim=True).clamp_min({floor!r}))"))
    res = run_cli("diagnose", "--quiet", str(fixed))
    assert res.code == 0, res.stderr
