"""`nanhunt diagnose` on scripts that crash with an error whose cause nanhunt can name:
GradScaler's order errors (``scaler.step()`` without ``scaler.update()``, ``unscale_`` twice)
and a constant beyond float16's range (``masked_fill(mask, -1e9)``, ``torch.full(..., 1e5)``).
Two architectures per class; the fixed variant of each script is its healthy control.

References that do not come from nanhunt: the script's own traceback under plain ``python``
(the same exception, the same last lines), and the script text (which line raises).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

#: key -> (script, expected rule, misuse code or module)
CRASHES = {
    "no_update_mlp": ("scaler_no_update_mlp.py", "scaler-crash", "step_without_update"),
    "no_update_transformer": ("scaler_no_update_transformer.py", "scaler-crash",
                              "step_without_update"),
    "unscale_twice_cnn": ("scaler_unscale_twice_cnn.py", "scaler-crash", "unscale_twice"),
    "unscale_twice_mlp": ("scaler_unscale_twice_mlp.py", "scaler-crash", "unscale_twice"),
    "masked_fill": ("masked_fill_attention_half.py", "range-constant", "attn"),
    "full": ("full_padding_half_cnn.py", "range-constant", "knn"),
}
#: the fixed variants run as healthy controls (one per kind of crash)
CONTROLS = ("no_update_mlp", "unscale_twice_cnn", "masked_fill", "full")


def _submit(cli) -> dict[tuple[str, bool], tuple]:
    """Every run of this module, in the session's shared pool (each made once per session:
    tests/integration/conftest.py): per (key, fixed), the futures of the nanhunt run and, for a
    broken script, of the script under plain python."""
    jobs = [(k, False) for k in CRASHES] + [(k, True) for k in CONTROLS]
    futures = {}
    for key, fixed in jobs:
        script = SCRIPTS / CRASHES[key][0]
        extra = ["--fixed"] if fixed else []
        # verify=True: the command exactly as a user types it (these crashes have no fix a
        # re-run could install, so no re-run is made either way)
        nh = cli.submit("diagnose", "--quiet", script, *extra, verify=True)
        plain = None if fixed else cli.python(script)
        futures[(key, fixed)] = (nh, plain)
    return futures


prefetch = _submit  # started when collection ends (tests/integration/conftest.py)


@pytest.fixture(scope="module")
def runs(cli) -> dict[tuple, tuple]:
    results = {}
    for job, (nh, plain) in _submit(cli).items():
        nh = nh.result()
        results[job] = (nh, plain and plain.result(), nh.report)
    return results


def _raising_line(stderr: str, script: str) -> int:
    """The line of ``script`` in the innermost frame of Python's own traceback."""
    lines = re.findall(rf'File ".*{re.escape(script)}", line (\d+)', stderr)
    return int(lines[-1])


@pytest.mark.parametrize("key", sorted(CRASHES))
def test_crash_is_diagnosed(runs, key):
    script, rule, detail = CRASHES[key]
    nh, plain, report = runs[(key, False)]
    # the script crashes on its own, with this error, at this line (the reference)
    assert plain.returncode == 1
    last = plain.stderr.strip().splitlines()[-1]
    assert last.startswith(("RuntimeError:", "AssertionError:"))
    line = _raising_line(plain.stderr, script)
    # under nanhunt: exit 1 (a problem found), the user's traceback as Python prints it
    assert nh.returncode == 1, nh.stderr[-3000:]
    tb = nh.stderr[nh.stderr.index("Traceback (most recent call last):"):]
    assert last in tb
    assert _raising_line(tb, script) == line
    assert "nanhunt/" not in tb.split(last)[0]  # no frame of ours in the user's traceback
    d = report["diagnosis"]
    assert report["crash"]["source"].endswith(f"{script}:{line}")
    assert d["rule"] == rule
    assert f"{script}:{line}" in d["message"]
    if rule == "scaler-crash":
        assert (d["kind"], d["phase"], d["data"]["misuse"]) == ("loss_scale", "loss_scaling",
                                                                detail)
        rec = report["recommendations"][0]
        assert rec["type"] == "scaler_usage"
        assert rec["snippet"].index("scaler.step(optimizer)") < rec["snippet"].index(
            "scaler.update()")
    else:
        assert (d["kind"], d["phase"], d["module"]) == ("overflow", "forward", detail)
        rec = report["recommendations"][0]
        assert rec["type"] == "finfo_constant"
        bound = "min" if key == "masked_fill" else "max"
        assert "torch.finfo(" in rec["snippet"] and f").{bound}" in rec["snippet"]
        compile(rec["snippet"], "snippet", "exec")
        assert d["data"]["constant"] == (-1e9 if key == "masked_fill" else 1e5)


@pytest.mark.parametrize("key", CONTROLS)
def test_fixed_script_is_quiet(runs, key):
    nh, _, report = runs[(key, True)]
    assert nh.returncode == 0, nh.stderr[-3000:]
    assert report["diagnosis"] is None
    assert report["crash"] is None
