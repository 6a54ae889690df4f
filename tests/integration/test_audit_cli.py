"""``nanhunt audit`` as a user runs it: the sensitive layer first, checked advice, quiet on
clean models, the script's output untouched, and the three report forms."""

from __future__ import annotations

import copy
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clirun import run_nanhunt, run_python

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"

# script, extra options, the module that must rank first (None: nothing may stand out); the
# CNN and transformer siblings of the first two run through the library in
# tests/unit/test_precision.py (cheaper: no second interpreter)
CASES = {
    "shift_mlp": ("audit/shift_mlp.py", [], "recenter"),
    "accumulate_mlp": ("audit/accumulate_mlp.py", [], "pool"),
    "rope_transformer": ("audit/rope_transformer.py", ["--target", "float16,bfloat16"],
                         "block.rope"),
    "fourier_mlp": ("audit/fourier_mlp.py", ["--target", "float16,bfloat16"], "encode"),
    "healthy_mlp": ("healthy_fp16.py", [], None),
}


def _run(args, cwd):
    return run_nanhunt(args, cwd, timeout=300)


def _audit(out: Path, name: str) -> tuple:
    script, opts, _culprit = CASES[name]
    steps = ["--steps", "6"] if "healthy" in name else []
    proc = _run(["audit", "--steps", "2", "--out", str(out), *opts, str(EX / script), *steps],
                ROOT)
    # the reference with the same threads as the audit (one: a reduction split over more
    # threads rounds differently)
    plain = run_python(EX / script, *steps, cwd=ROOT, timeout=300)
    return proc, plain


#: cases run with -m slow only, for the suite's time (the default suite keeps the audit CLI on
#: the MLPs, the two-target option on fourier_mlp, and the healthy run)
SLOW = {"rope_transformer"}


def _case(cli, name: str):
    return cli.call(("audit-cli", name), lambda out, n=name: (out, *_audit(out, n)))


def prefetch(cli) -> dict:
    """Every default case's audit and plain run, in the session's shared pool (tests/
    integration/conftest.py; started when collection ends); each audit writes into a fresh
    folder."""
    return {name: _case(cli, name) for name in sorted(CASES) if name not in SLOW}


@pytest.fixture(scope="module", params=[
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(CASES)])
def audited(request, cli):
    out, proc, plain = _case(cli, request.param).result()
    report = json.loads((out / "report.json").read_text())
    return request.param, CASES[request.param][2], proc, plain, report, out


def test_sensitive_layer_ranks_first_by_a_wide_margin(audited):
    name, culprit, proc, _plain, report, _ = audited
    audits = [report["precision"], *report["precision"]["compare"]]
    for a in audits:
        ranked = sorted((x for x in a["layers"] if x["rank"]), key=lambda x: x["rank"])
        out = [x["module"] for x in a["layers"] if x["stands_out"]]
        if culprit is None:
            assert out == [], (name, a["target"])
            continue
        assert ranked[0]["module"] == culprit, (name, a["target"], ranked[:3])
        assert out == [culprit]
        assert ranked[1]["sqnr_db"] - ranked[0]["sqnr_db"] >= 20
        assert ranked[0]["reasons"]
    if culprit is None:
        assert report["recommendations"] == [] and proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 1, proc.stderr
        for rec in report["recommendations"]:
            assert rec["type"] == "fp32_module" and rec["data"]["modules"] == [culprit]
            assert rec["verified"], rec["verification"]
            before, after = rec["data"]["loss_error_before"], rec["data"]["loss_error_after"]
            assert after <= 0.5 * before


def test_script_output_and_losses_are_untouched(audited):
    _name, _c, proc, plain, report, _ = audited
    # every loss printed bit for bit as without nanhunt (shift_mlp has dropout: the audit's
    # replays draw random numbers, and must leave the script's generator where it was)
    assert proc.stdout == plain.stdout
    pr = report["precision"]
    if pr["mode"] == "measured":  # the target replay reproduced the run, dropout masks included
        assert pr["reproduced"] is True


def test_reports_render_in_terminal_json_and_html(audited):
    _name, culprit, proc, _plain, report, out = audited
    assert report["precision"]["target"] in ("float16", "bfloat16")
    for layer in report["precision"]["layers"]:
        assert {"module", "type", "sqnr_db", "sqnr_db_end_to_end", "grad_sqnr_db",
                "rank"} <= set(layer)
    assert {"target", "float32"} <= set(report["precision"]["loss"])
    html = (out / "report.html").read_text()
    assert 'id="precision"' in html and 'class="chart sqnr"' in html
    # the chart marks every layer across which the end-to-end drift jumps 20 dB or more
    # (inputs not exact), and only those
    jumps = [[x["module"] for x in a["layers"]
              if isinstance(x["drift_jump_db"], float) and x["drift_jump_db"] >= 20
              and isinstance(x["sqnr_db_end_to_end_in"], float)
              and (x["rank"] is not None or x["leaf"])]
             for a in (report["precision"], *report["precision"]["compare"])]  # one chart each
    assert html.count('<line class="jump"') == sum(map(len, jumps))
    for m in {m for ms in jumps for m in ms}:
        assert f"<title>{m}: the end-to-end SQNR drops" in html
    # the culprit's inputs carry float16's drift and it makes far more; fourier_mlp's encode
    # takes the batch itself (exact inputs: its jump is "inf", the drift starts there, no bar)
    if culprit is not None and culprit != "encode":
        assert culprit in jumps[0]
    assert not re.search(r'(src|href)="(https?:)?//', html)
    text = (out / "report.txt").read_text()
    assert "Precision audit" in text
    if culprit is not None:
        assert culprit in proc.stderr and "AUDIT" in proc.stderr
        assert " jump " in proc.stderr
    # no terminal: rich renders 80 columns; code snippets are the exception (never wrapped, so
    # that a copied snippet parses)
    code = {"   " + ln for r in report.get("recommendations", []) for ln in
            (r.get("snippet") or "").splitlines()}
    assert all(len(line) <= 80 for line in proc.stderr.splitlines()
               if not line.startswith("reports:") and line.rstrip() not in code)
    again = _run(["report", str(out / "report.json")], ROOT)
    assert again.returncode == 0 and "Precision audit" in again.stdout


def _losses(model, x, y, autocast):
    import torch.nn.functional as F

    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        return F.cross_entropy(model(x), y).item()


_BY_HAND = {"shift_mlp": ("shift_mlp.py", "MLP"), "accumulate_mlp": ("accumulate_mlp.py",
                                                                     "DeepSet")}


def test_applying_the_printed_fix_by_hand_lowers_the_loss_error(audited):
    """Independent of nanhunt's replay: the printed snippet applied to a copy of the model."""
    name, module, _proc, _plain, report, _ = audited
    if name not in _BY_HAND:  # the shared fixture's other scripts: checked above
        pytest.skip("checked by hand for the MLP scripts only")
    script, cls = _BY_HAND[name]
    rec = report["recommendations"][0]
    ns = runpy.run_path(str(EX / "audit" / script), run_name="example")
    torch.manual_seed(3)
    model = ns[cls]().eval()  # no dropout: both precisions see the same network
    if cls == "MLP":
        x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    else:
        x, y = torch.randn(4, 3000, 4) + 1.0, torch.randint(0, 3, (4,))
    fixed = copy.deepcopy(model)
    scope = {"model": fixed}
    exec(rec["helper"] + "\n" + rec["snippet"], scope)  # as printed: the helper, then the code
    ref = _losses(model, x, y, autocast=False)
    err_before = abs(_losses(model, x, y, autocast=True) - ref) / abs(ref)
    err_after = abs(_losses(fixed, x, y, autocast=True) - ref) / abs(ref)
    assert module in rec["snippet"]
    assert err_after < 0.5 * err_before


def test_bad_input_is_one_line(tmp_path):
    proc = _run(["audit", "--target", "float64", "x.py"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("nanhunt: unknown target format")
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = _run(["audit", "missing.py"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == "nanhunt: no such script: missing.py"
    proc = _run(["audit", "--steps", "0", "missing.py"], tmp_path)
    assert proc.returncode == 2 and "at least 1" in proc.stderr


def test_transparent_runner(tmp_path):
    script = tmp_path / "who.py"
    script.write_text("import os, sys\nprint(__name__, sys.argv, os.getcwd())\nsys.exit(4)\n")
    plain = subprocess.run([sys.executable, str(script), "--x", "--"], cwd=tmp_path,
                           capture_output=True, text=True)
    under = _run(["audit", "--quiet", "--out", str(tmp_path / "o"), str(script), "--x", "--"],
                 tmp_path)
    assert under.stdout == plain.stdout and under.returncode == plain.returncode == 4


def test_audit_help_and_usage_errors_never_import_torch(tmp_path):
    code = ("import sys\nfrom nanhunt.cli.main import main\n"
            "codes = [main(['audit', '--help']), main(['audit', '--target', 'fp64', 'x.py'])]\n"
            "print(codes, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "[0, 2] False", out.stderr
