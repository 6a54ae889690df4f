"""Diagnosis by experiment, end to end: the control, the ladder's rungs and the verdict they
prove, each checked against the script itself (run here with the rung's change installed, or
run again by hand), not against nanhunt's own reading."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_fixes import paste, run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"
EXAMPLES = ROOT / "examples"


def prefetch(cli) -> dict:
    return {
        "first": cli.submit("diagnose", SCRIPTS / "first_run_only.py", "--marker", "marker",
                            verify=True),
        "ffn": cli.submit("diagnose", EXAMPLES / "ffn_overflow.py", verify=True),
        # shared with test_verify_rerun.py (the same command line)
        "zero": cli.submit("diagnose", SCRIPTS / "zero_norm_div.py", verify=True),
        "silent": cli.submit("diagnose", SCRIPTS / "silent_half_updates.py", verify=True),
        "healthy": cli.submit("diagnose", SCRIPTS / "precision_paths.py", "--steps", "24",
                              verify=True),
        "loss-op": cli.submit("diagnose", "--quiet", SCRIPTS / "log_softmax_loss.py",
                              verify=True),
        "loss-op-unverified": cli.submit("diagnose", "--quiet", SCRIPTS / "log_softmax_loss.py"),
        "loss-op-plain": cli.python(SCRIPTS / "log_softmax_loss.py"),
        "scores": cli.submit("diagnose", "--quiet", SCRIPTS / "attention_by_hand.py", "--plant",
                             "scores", "--steps", "5", verify=True),
        "padded": cli.submit("diagnose", "--quiet", SCRIPTS / "attention_by_hand.py", "--plant",
                             "padded", "--steps", "5"),
        "healthy-plain": cli.python(SCRIPTS / "precision_paths.py", "--steps", "24"),
        "rows": cli.submit("diagnose", "--quiet", SCRIPTS / "bad_rows_cnn.py", verify=True),
        "outlier": cli.submit("diagnose", "--quiet", SCRIPTS / "outlier_batch.py", verify=True),
    }


@pytest.fixture(scope="module")
def runs(cli) -> dict:
    return prefetch(cli)


def first_nan(lines: list[str]) -> int | None:
    for line in lines:
        if line.split()[-1] == "nan":
            return int(line.split()[1])
    return None


def _headline(res) -> str:
    """The verdict panel's text, unwrapped."""
    panel = res.text.split("\n\n")[0]
    return " ".join(panel.replace("│", " ").replace("╭", " ").replace("╰", " ").split())


def _runs(report: dict) -> dict:
    return {e["rung"]: e for e in report["experiments"]["runs"] if e["rung"] != "fix"}


def test_a_failure_that_does_not_recur_verifies_nothing_and_says_so(runs):
    res = runs["first"].result()
    assert res.code == 1, res.stderr
    report = res.report
    assert report["schema_version"] == 2
    assert report["first_failure"]["step"] == 2
    ex = report["experiments"]
    assert ex["control_reproduced"] is False and ex["verdict"] == "not-reproduced"
    assert _runs(report)["control"]["outcome"] == "trained"
    assert not any(r["verified"] for r in report["recommendations"])
    assert all("did not recur" in r["verification"] for r in report["recommendations"])
    assert "did not recur in an unfixed re-run: nothing verified" in _headline(res)
    # the losses of both runs to the failure step, and the control's equal before it
    assert "losses to step 2: original run 1.744, 1.543, nan; control 1.744, 1.543, 1.338" \
        in " ".join(res.text.split())
    assert ex["deterministic"] is True
    # the script itself agrees: run again where it ran, it does not fail
    again = subprocess.run([sys.executable, str(SCRIPTS / "first_run_only.py"), "--marker",
                            "marker"], cwd=res.cwd, capture_output=True, text=True, check=True)
    assert first_nan(again.stdout.splitlines()) is None


def test_a_float16_overflow_is_a_range_failure_proven_by_float32_and_bfloat16(runs):
    res = runs["ffn"].result()
    assert res.code == 1, res.stderr
    report = res.report
    ex = report["experiments"]
    runs = _runs(report)
    assert ex["control_reproduced"] is True and ex["deterministic"] is True
    assert runs["control"]["outcome"] == "recurred" and runs["control"]["failure_step"] == 3
    assert runs["fp32"]["outcome"] == "trained" and runs["bf16"]["outcome"] == "trained"
    assert ex["verdict"] == "precision-range" and ex["source"] == "experiments"
    # the region rung: the module where the overflow was seen, alone in float32, trains: one
    # re-run, cited first (the budget may cut it short on a loaded machine)
    culprit = "encoder.blocks.1.ffn.wo"
    region = [e for e in report["experiments"]["runs"] if e["rung"] == "region"]
    if not ex["not_run"]:
        assert ex["region"] == f"fp32:{culprit}..", [(e["fixes"], e["outcome"]) for e in region]
        assert f"keeping `{culprit}` in float32 (its output too) removes the failure; bfloat16 " \
            "does too; float32 everywhere does" in _headline(res)
        assert [e["fixes"] for e in region] == [[ex["region"]]]
    # the script agrees: float16 fails at step 3, float32 and bfloat16 installed here do not;
    # nor does the region, and the half of the tree the bisection left out fails as before
    script = EXAMPLES / "ffn_overflow.py"
    assert first_nan(run_script(script)) == 3
    assert first_nan(run_script(script, fixes=["fp32-all"])) is None
    assert first_nan(run_script(script, fixes=["bf16"])) is None
    assert first_nan(run_script(script, fixes=[ex["region"]])) is None
    # ...and it is that module: the same in the other block does not remove the failure
    assert first_nan(run_script(script, fixes=["fp32:encoder.blocks.0.ffn.wo.."])) == 3
    rec = next(r for r in report["recommendations"] if r["verified"])
    assert rec["fix"] == [ex["region"]] and rec["type"] == "fp32_module"
    held = rec["tries"][-1]["conditions"]
    # learned: not applicable, the control failed at step 3 (too few losses before it)
    assert held == {"control_reproduced": True, "past_horizon": True, "finite": True,
                    "no_skip_streak": True, "learned": None, "within_fp32_noise": True}
    assert first_nan(run_script(script, fixes=rec["fix"])) is None
    html = res.html
    assert 'id="experiments"' in html and "experiment-loss" in html
    assert html.count('class="rank-series"') >= 4  # original, control, fp32, the fix


def test_a_zero_division_is_not_precision_specific(runs):
    res = runs["zero"].result()
    report = res.report
    ex = report["experiments"]
    runs = _runs(report)
    assert runs["fp32"]["outcome"] == "recurred" and runs["fp32"]["failure_step"] == 2
    assert ex["verdict"] == "not-precision", ex["verdict_text"]
    assert first_nan(run_script(SCRIPTS / "zero_norm_div.py", fixes=["fp32-all"])) == 2
    # replacing step 2's batch moves the failure to the next empty record (step 5)
    assert runs["skip-batch"]["outcome"] == "moved" and runs["skip-batch"]["failure_step"] == 5
    assert first_nan(run_script(SCRIPTS / "zero_norm_div.py", fixes=["skip-batch=2"])) == 5
    for name in ("control", "fp32", "lr-0.1", "lr-0.01", "skip-batch"):
        assert name in res.text


def _losses(lines: list[str]) -> list[float]:
    return [float(line.split()[-1]) for line in lines]


def test_a_run_that_learns_less_than_float32_is_a_silent_precision_failure(runs):
    res = runs["silent"].result()
    assert res.code == 1, res.stderr  # never OK: no NaN, but it does not learn
    report = res.report
    assert report["first_failure"] is None
    ex = report["experiments"]
    runs_ = _runs(report)
    assert runs_["fp32"]["outcome"] == "trained"
    if report["diagnosis"]["kind"] == "silent_precision":  # found by the comparison alone
        assert ex["verdict"] == "silent-precision", ex["verdict_text"]
        assert runs_["control"]["outcome"] == "trained"
    else:  # a rule flagged the stalled loss first: the ladder reads it; bfloat16 stalls too
        # bfloat16 stalls too (resolution), unless the --budget left it out on a loaded machine
        assert ex["verdict"] in ("precision-resolution", "precision"), ex["verdict_text"]
        assert runs_["control"]["outcome"] == "recurred"
        # the weights are float16 in the optimizer: float32 master weights alone (the forward
        # and backward still float16) train, the narrowest cure, verified first
        assert runs_["fp32-master"]["outcome"] == "trained", runs_["fp32-master"]
        assert ex["verdict_text"].startswith("float32 master weights and optimizer state "
                                             "remove the failure")
        first = report["recommendations"][0]
        assert first["fix"] == ["fp32-master"] and first["verified"], first
        # installed from outside, that fix makes the script itself learn like float32
        fixed = _losses(run_script(SCRIPTS / "silent_half_updates.py", fixes=["fp32-master"]))
        assert fixed[-1] < 0.8 * fixed[0]
    # the script's own float32 path is the reference: the fp32 experiment's losses are its
    script = SCRIPTS / "silent_half_updates.py"
    fp32 = _losses(run_script(script, ["--fp32"]))
    ran = runs_["fp32"]["losses"]  # to the horizon, or the whole script
    assert ran == pytest.approx(fp32[:len(ran)], abs=1e-4)  # printed to 4 places
    half = _losses(run_script(script))
    assert half[-1] == half[0] and fp32[-1] < 0.8 * fp32[0]  # float16 learns nothing
    assert "float32" in _headline(res)


def test_a_healthy_mixed_precision_run_is_compared_and_ok(runs):
    res = runs["healthy"].result()
    assert res.code == 0, res.stderr
    ex = res.report["experiments"]
    assert ex["verdict"] == "" and ex["verdict_text"].startswith("no silent precision loss")
    assert {e["rung"] for e in ex["runs"]} == {"control", "fp32"}
    assert res.report["diagnosis"] is None
    # with re-runs on (fork servers forked from nanhunt before the script started, their
    # modules imported first) the script's own output is python's, bit for bit
    assert res.stdout == runs["healthy-plain"].result().stdout


def test_the_control_names_the_op_and_line_of_a_failure_outside_every_module(runs):
    """-log(softmax(x)) written in the loop, no module around it: the control re-run watches
    the failing step op by op and names the op and the line; the hand count is the script's
    own text (the one line that calls torch.log) and its losses under plain python (the first
    inf)."""
    script = SCRIPTS / "log_softmax_loss.py"
    lines = script.read_text().splitlines()
    (lineno,) = [i + 1 for i, text in enumerate(lines) if "torch.log(" in text]
    res = runs["loss-op"].result()
    assert res.code == 1, res.stderr
    plain = runs["loss-op-plain"].result()
    printed = [ln.split() for ln in plain.stdout.splitlines() if ln.startswith("step ")]
    bad = next(int(w[1]) for w in printed if w[-1] in ("inf", "nan"))
    f = res.report["first_failure"]
    assert (f["step"], f["phase"], f["module"]) == (bad, "forward", "")
    assert f["op"] == "aten.log"
    assert f["source"] == f"{script}:{lineno}" and "torch.log(" in f["source_line"]
    said = [e for e in res.report["diagnosis"]["evidence"] if "control re-run" in e]
    assert said and "exact zeros" in said[0]  # softmax's float16 underflow, log's input
    assert any("log_softmax" in e for e in res.report["diagnosis"]["evidence"])
    # without the re-runs nothing watched the step: no op is named
    unverified = runs["loss-op-unverified"].result().report["first_failure"]
    assert (unverified["step"], unverified["op"]) == (bad, None)


def test_the_source_rung_keeps_the_failing_lines_in_float32(runs):
    """The op the control named was written on the script's own line (not inside a module):
    the source rung keeps the ops of that statement, then of the block around it, in float32.
    Counted by hand from the script's text: log alone in float32 still takes log of a float16
    softmax that already underflowed to 0; the `with autocast` block (softmax and log) trains.
    Checked against the script itself with each fix installed here."""
    script = SCRIPTS / "log_softmax_loss.py"
    lines = script.read_text().splitlines()
    (log_line,) = [i + 1 for i, text in enumerate(lines) if "torch.log(" in text]
    (with_line,) = [i + 1 for i, text in enumerate(lines) if "with torch.autocast" in text]
    report = runs["loss-op"].result().report
    ex = report["experiments"]
    assert ex["source_line"] == f"{script}:{log_line}"
    tried = {e["fixes"][0]: e["outcome"] for e in ex["runs"] if e["rung"] == "lines"}
    narrow = f"fp32-lines:{script}:{log_line}"
    block = f"fp32-lines:{script}:{with_line}-{log_line}"
    assert tried == {narrow: "recurred", block: "trained"}, tried
    # every re-run its own report (the two lines rungs ran at once, in folders of their own)
    reports = [e["report"] for e in ex["runs"] if e["report"]]
    assert len(set(reports)) == len(reports), reports
    assert ex["lines"] == block
    assert ex["verdict_text"].startswith(
        f"keeping the ops written on lines {with_line}-{log_line} of log_softmax_loss.py in "
        f"float32 removes the failure; line {log_line} of log_softmax_loss.py alone does not")
    first = report["recommendations"][0]
    assert first["type"] == "fp32_lines" and first["fix"] == [block] and first["verified"]
    # the script agrees
    assert first_nan(run_script(script)) is not None
    assert first_nan(run_script(script, fixes=[narrow])) is not None
    assert first_nan(run_script(script, fixes=[block])) is None


def test_the_source_rung_names_the_overflowing_line_of_a_hand_written_attention(runs):
    """A second architecture: attention written by hand in the model's own forward, whose
    ``q @ k^T`` line overflows float16. The control's watch names that line (counted by hand
    from the script's text); float32 for its ops alone trains, cited first and verified; the
    script with that fix installed here prints no nan, without it does."""
    script = SCRIPTS / "attention_by_hand.py"
    lines = script.read_text().splitlines()
    (line,) = [i + 1 for i, t in enumerate(lines) if "att = (q @ k.transpose(-2, -1))" in t]
    report = runs["scores"].result().report
    ex = report["experiments"]
    assert ex["source_line"] == f"{script}:{line}"
    assert ex["lines"] == f"fp32-lines:{script}:{line}"
    assert ex["verdict_text"].startswith(f"keeping the ops written on line {line} of "
                                         "attention_by_hand.py in float32 removes the failure")
    first = report["recommendations"][0]
    assert first["type"] == "fp32_lines" and first["verified"]
    args = ["--plant", "scores", "--steps", "5"]
    assert first_nan(run_script(script, args)) == 3
    assert first_nan(run_script(script, args, fixes=[ex["lines"]])) is None


def test_a_hand_written_attention_row_padded_throughout_gets_the_mask_advice(runs):
    """A second architecture for a row masked throughout: the softmax on the script's line is
    named, with the evidence; the first advice is the mask's, and its finite fill (the
    script's --fill finfo, the snippet's torch.finfo(att.dtype).min) trains where -inf does
    not."""
    script = SCRIPTS / "attention_by_hand.py"
    lines = script.read_text().splitlines()
    (line,) = [i + 1 for i, t in enumerate(lines) if "att = torch.softmax(att" in t]
    report = runs["padded"].result().report
    f = report["first_failure"]
    assert (f["step"], f["op"], f["source"]) == (3, "aten._softmax", f"{script}:{line}")
    assert any("-inf throughout" in e for e in report["diagnosis"]["evidence"])
    assert report["recommendations"][0]["type"] == "fix_mask"
    args = ["--plant", "padded", "--steps", "5"]
    assert first_nan(run_script(script, args)) == 3
    assert first_nan(run_script(script, [*args, "--fill", "finfo"])) is None


def test_bad_samples_are_shown_by_replacing_those_samples_alone(runs, tmp_path):
    """Two corrupt images in one batch of a CNN (bfloat16, no GradScaler: the NaN reaches every
    weight): the rung that replaces those two rows alone trains, as the batch rung does, while
    float32 and a lower lr do not; the data fix is verified by that rung's re-run. Checked
    against the script: the spec's losses are the script's own with the rows replaced by hand,
    and the printed snippet, pasted into a copy, trains to the end."""
    res = runs["rows"].result()
    assert res.code == 1, res.stderr
    report = res.report
    f = report["first_failure"]
    assert (f["step"], f["phase"], f["batch_rows"]) == (3, "data", 8)
    assert sorted({i for idx in f["bad_samples"].values() for i in idx}) == [2, 6]
    ex, rungs = report["experiments"], _runs(report)
    assert ex["control_reproduced"] is True and ex["verdict"] == "data"
    assert rungs["skip-samples"]["fixes"] == ["skip-samples=3:2,6"]
    assert rungs["skip-samples"]["outcome"] == "trained"
    assert rungs["fp32"]["outcome"] == "recurred" and rungs["lr-0.1"]["outcome"] == "recurred"
    assert "replacing samples 2, 6 of the failing batch removes it" in ex["verdict_text"]
    rec = next(r for r in report["recommendations"] if r["type"] == "fix_data")
    assert rec["fix"] == ["skip-samples=3:2,6"] and rec["verified"] is True
    assert rec["tries"][-1]["conditions"]["control_reproduced"] is True
    script = SCRIPTS / "bad_rows_cnn.py"
    plain = run_script(script)
    assert first_nan(plain) == 3
    fixed = run_script(script, fixes=rec["fix"])
    assert fixed == run_script(script, ["--replace-rows"])
    assert first_nan(fixed) is None and len(fixed) == 12
    # the snippet (drop the non-finite rows) in a copy of the script, before the model runs
    copy = tmp_path / "bad_rows_cnn.py"
    copy.write_text(paste(script.read_text(), rec["snippet"] + "\noptimizer.zero_grad()",
                          helper=rec["helper"], replace="optimizer.zero_grad()"))
    out = subprocess.run([sys.executable, str(copy)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 12 and first_nan(lines) is None
    assert lines[:3] == plain[:3] and lines[3] != plain[3]


def test_the_batch_that_started_a_divergence_is_found_before_the_step_a_rule_fired(runs):
    """A float32 MLP whose step 8 batch is in other units (x 300): nothing is non-finite, the
    exploding-gradient rule fires at step 12. The batch rungs try step 12's batch and, because
    the control's loss blew up at step 8, steps 8 and 7's: replacing step 8's alone trains (a
    lower lr and clipping do not), so the verdict is data and the fix skips that batch,
    verified by the rung's re-run. Checked against the script's own replacement by hand."""
    res = runs["outlier"].result()
    assert res.code == 1, res.stderr
    report = res.report
    ex = report["experiments"]
    batches = {e["fixes"][0]: e["outcome"] for e in report["experiments"]["runs"]
               if e["rung"] == "skip-batch"}
    assert batches == {"skip-batch=12": "diverged", "skip-batch=8": "trained",
                       "skip-batch=7": "diverged"}
    rungs = _runs(report)
    assert rungs["lr-0.01"]["outcome"] == "diverged" and rungs["clip"]["outcome"] == "diverged"
    assert ex["verdict"] == "data"
    assert "replacing step 8's batch removes it: a data failure (the batch of step 8)" \
        in ex["verdict_text"]
    rec = report["recommendations"][0]
    assert rec["type"] == "fix_data" and rec["fix"] == ["skip-batch=8"] and rec["verified"]
    script = SCRIPTS / "outlier_batch.py"
    fixed = run_script(script, fixes=rec["fix"])
    assert fixed == run_script(script, ["--replace", "8"])
    plain = run_script(script)
    loss = [float(line.split()[-1]) for line in fixed]
    assert max(loss) < 2 * loss[0] and loss[-1] < loss[0] / 10
    assert max(float(line.split()[-1]) for line in plain) > 1e4
