"""Fixes installed from outside a script do what their snippet does when pasted into it.

Each test runs a training script twice in this process: once unmodified with the fix installed
(:func:`nanhunt.experiment.fixes.install`), once as a copy with the snippet applied by hand, as a
user
would; the printed losses must be identical, and different from the unfixed run's (so the fix
did something).
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nanhunt.errors import NanhuntError
from nanhunt.experiment.fixes import FixMismatch, install
from nanhunt.fixspec import SnippetContext, parse_fix, snippet

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SCRIPTS = ROOT / "tests" / "scripts"


def run_script(path: Path, args: list[str] = (), fixes: list[str] = ()) -> list[str]:
    """The script's printed lines, with ``fixes`` installed around it."""
    out = io.StringIO()
    saved = sys.argv[:]
    sys.argv = [str(path), *args]
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(contextlib.redirect_stdout(out))
            if fixes:
                stack.enter_context(install([parse_fix(f) for f in fixes]))
            torch.manual_seed(0)
            runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = saved
    return out.getvalue().splitlines()


def paste(source: str, code: str, *, after: str | None = None, replace: str | None = None,
          helper: str = "") -> str:
    """Apply a snippet as a user would: imports and helper at the top, the code after the
    line holding ``after`` (same indentation) or in place of the line holding ``replace``."""
    lines = source.splitlines()
    anchor = after or replace
    i = next(i for i, line in enumerate(lines) if anchor in line)
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    imports = [ln for ln in (helper + "\n" + code).splitlines()
               if ln.startswith(("import ", "from "))]
    body = "\n".join(ln for ln in code.splitlines() if ln not in imports)
    block = textwrap.indent(body, indent).splitlines()
    lines = lines[: i + 1] + block + lines[i + 1:] if after else lines[:i] + block + lines[i + 1:]
    helper_body = "\n".join(ln for ln in helper.splitlines() if ln not in imports)
    top = next(j for j, line in enumerate(lines) if line.startswith(("import ", "from ")))
    return "\n".join(lines[:top] + imports + [helper_body] + lines[top:]) + "\n"


def check_same(tmp_path: Path, script: Path, fix: str, args: list[str] = (), *,
               ctx: SnippetContext | None = None, **where: str) -> list[str]:
    spec = parse_fix(fix)
    snip = snippet([spec], ctx or SnippetContext(device="cpu"))
    copy = tmp_path / script.name
    copy.write_text(paste(script.read_text(), snip.code, helper=snip.helper, **where))
    by_hand = run_script(copy, args)
    installed = run_script(script, args, [fix])
    plain = run_script(script, args)
    assert installed == by_hand, (fix, copy.read_text())
    assert installed != plain, f"{fix} changed nothing"
    return installed


def test_fp32_region_equals_its_snippet(tmp_path):
    lines = check_same(tmp_path, EXAMPLES / "ffn_overflow.py",
                       "fp32:encoder.blocks.1.ffn.wo..norm", after="model.encoder.apply")
    assert "nan" not in " ".join(lines)


def test_fp32_pattern_equals_its_snippet(tmp_path):
    check_same(tmp_path, EXAMPLES / "ffn_overflow.py", "fp32:encoder.blocks.*.ffn",
               after="model.encoder.apply")


def test_clamp_equals_its_snippet(tmp_path):
    check_same(tmp_path, EXAMPLES / "ffn_overflow.py", "clamp:encoder.blocks.*.ffn=1000",
               after="model.encoder.apply")


def test_floor_equals_the_edited_line(tmp_path):
    script = EXAMPLES / "sqrt_backward.py"
    line = "rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True))"
    ctx = SnippetContext(device="cpu", source="sqrt_backward.py:27", source_line=line)
    spec = parse_fix("floor:norm:sqrt=6.103515625e-05")
    code = snippet([spec], ctx).code
    comment, edited = code.splitlines()
    assert comment.startswith("# sqrt_backward.py:27")
    copy = tmp_path / script.name
    copy.write_text(script.read_text().replace(line, edited))
    installed = run_script(script, [], [str(spec)])
    assert installed == run_script(copy)
    assert "nan" not in " ".join(installed)
    assert "nan" in " ".join(run_script(script))


def test_floor_of_a_division_by_a_zero_norm(tmp_path):
    lines = check_same(tmp_path, SCRIPTS / "zero_norm_div.py", "floor:head.normalize:div=1e-06",
                       replace="return x / x.norm(dim=-1, keepdim=True)",
                       ctx=SnippetContext(device="cpu",
                                          source_line="return x / x.norm(dim=-1, keepdim=True)"))
    assert "nan" not in " ".join(lines)


def test_eps_equals_its_snippet(tmp_path):
    check_same(tmp_path, SCRIPTS / "t5_siblings.py", "eps:encoder.*layer_norm=1000000",
               after="model = ")


def test_optimizer_eps_equals_its_snippet(tmp_path):
    check_same(tmp_path, EXAMPLES / "log_zero_loss.py", "opt-eps=0.001", after="optimizer = ")


def test_init_scale_and_growth_interval_equal_their_snippets(tmp_path):
    script = EXAMPLES / "ffn_overflow.py"
    fixes = ["init-scale=1024", "growth-interval=3"]
    snip = snippet([parse_fix(f) for f in fixes], SnippetContext(device="cpu"))
    line = 'scaler = torch.amp.GradScaler("cpu")'
    # the user merges both into their one GradScaler(...) line
    merged = 'scaler = torch.amp.GradScaler("cpu", init_scale=1024, growth_interval=3)'
    assert "init_scale=1024" in snip.code and "growth_interval=3" in snip.code
    copy = tmp_path / script.name
    copy.write_text(script.read_text().replace(line, merged))
    args = ["--steps", "8"]
    assert run_script(script, args, fixes) == run_script(copy, args)


@pytest.mark.parametrize(("script", "anchor", "scaler"), [
    (EXAMPLES / "ffn_overflow.py", "scaler.step(optimizer)", True),
    (EXAMPLES / "sqrt_backward.py", "optimizer.step()", False),
])
def test_clip_equals_its_snippet(tmp_path, script, anchor, scaler):
    spec = parse_fix("clip=0.5")
    snip = snippet([spec], SnippetContext(device="cpu", scaler=scaler))
    source = script.read_text()
    lines = source.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.strip() == anchor)
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    body = [ln for ln in snip.code.splitlines() if ln and not ln.startswith("import ")]
    lines[i:i] = [indent + ln for ln in body]  # before the step, as the snippet says
    copy = tmp_path / script.name
    copy.write_text("\n".join(lines) + "\n")
    assert run_script(script, [], [str(spec)]) == run_script(copy)
    assert run_script(script, [], [str(spec)]) != run_script(script)


def test_lr_factor_equals_its_snippet(tmp_path):
    check_same(tmp_path, EXAMPLES / "high_lr.py", "lr-factor=0.001", after="optimizer = ")


def test_fp32_master_equals_its_snippet(tmp_path):
    script = EXAMPLES / "high_lr.py"
    snip = snippet([parse_fix("fp32-master")], SnippetContext(device="cpu"))
    masters, call = snip.code.splitlines()
    source = script.read_text().replace("        optimizer.step()\n",
                                        "        " + call.split("#")[0].strip() + "\n")
    copy = tmp_path / script.name
    copy.write_text(paste(source, masters, after="optimizer = ", helper=snip.helper))
    args = ["--lr", "1e-5", "--steps", "4"]
    installed = run_script(script, args, ["fp32-master"])
    assert installed == run_script(copy, args)
    assert installed != run_script(script, args)


def _lines_of(text: str, *needles: str) -> list[int]:
    lines = text.splitlines()
    return [next(i + 1 for i, t in enumerate(lines) if n in t) for n in needles]


def test_fp32_lines_equals_its_snippet(tmp_path):
    """The ops written on the script's softmax and log lines in float32: installed from
    outside, and as the printed helper pasted into a copy (the copy's own line numbers, since
    the helper moves them), the same losses, and not the float16 run's."""
    script = SCRIPTS / "log_softmax_loss.py"
    a, b = _lines_of(script.read_text(), "torch.softmax(", "torch.log(")
    spec = f"fp32-lines:{script.name}:{a}-{b}"
    snip = snippet([parse_fix(spec)], SnippetContext(device="cpu"))
    copy = tmp_path / script.name
    text = paste(script.read_text(), "PLACEHOLDER", after="opt = ", helper=snip.helper)
    ca, cb = _lines_of(text, "torch.softmax(", "torch.log(")
    code = snippet([parse_fix(f"fp32-lines:{script.name}:{ca}-{cb}")],
                   SnippetContext(device="cpu")).code
    copy.write_text(text.replace("PLACEHOLDER", code.split("#")[0].strip()))
    installed = run_script(script, [], [spec])
    # the pasted helper stays entered for the rest of its process: run the copy in its own
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    by_hand = subprocess.run([sys.executable, str(copy)], capture_output=True, text=True,
                             env=env, check=True).stdout.splitlines()
    assert installed == by_hand
    plain = run_script(script)
    assert installed != plain and "nan" in plain[-1] and "nan" not in installed[-1]


def test_fp32_lines_parses_and_refuses_bad_ranges():
    assert str(parse_fix("fp32-lines:train.py:57")) == "fp32-lines:train.py:57"
    assert str(parse_fix("fp32-lines:/a/b/train.py:56-57")) == "fp32-lines:/a/b/train.py:56-57"
    for bad in ("fp32-lines:train.py", "fp32-lines:train.py:9-3", "fp32-lines::3",
                "fp32-lines:train.py:x"):
        with pytest.raises(NanhuntError, match="fp32-lines"):
            parse_fix(bad)


def test_fp32_lines_that_run_no_op_say_so():
    fixes = install([parse_fix("fp32-lines:log_softmax_loss.py:1")])
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(SCRIPTS / "log_softmax_loss.py"), run_name="__main__")
    finally:
        message = fixes.uninstall()
    assert message is not None and "no torch op ran on those lines" in message


@pytest.mark.parametrize(("fix", "message"), [
    ("fp32:encoder.blocks.9.ffn", "matches no module"),
    ("clamp:encoder.block.*.ffn.wo=1", "did you mean"),
    ("eps:encoder.blocks.0.ffn.wo=0.1", "has no eps attribute"),
    ("opt-eps=0.1", "SGD has no eps"),
])
def test_a_fix_that_does_not_apply_stops_the_run_with_one_line(fix, message):
    with pytest.raises(FixMismatch, match=message):
        run_script(EXAMPLES / "ffn_overflow.py", [], [fix])


def test_a_fix_needing_a_scaler_says_there_is_none():
    fixes = install([parse_fix("init-scale=8")])
    with contextlib.redirect_stdout(io.StringIO()):
        sys.argv, saved = ["x", "--steps", "1"], sys.argv
        try:
            runpy.run_path(str(EXAMPLES / "sqrt_backward.py"), run_name="__main__")
        finally:
            sys.argv = saved
    assert "made no GradScaler" in fixes.uninstall()


@pytest.mark.parametrize("text", [
    "fp32:a.*.wo..norm", "fp32:a,b..c,d", "fp32:x", "clamp:a.b=64504", "floor:n:sqrt=6.1e-05",
    "floor:a.b:div=1e-06", "eps:n=1e-05", "opt-eps=0.0001", "init-scale=1024",
    "growth-interval=4000", "clip=1", "lr-factor=0.1", "fp32-master",
])
def test_specs_round_trip(text):
    spec = parse_fix(text)
    assert str(spec) == text
    assert parse_fix(str(spec)) == spec


@pytest.mark.parametrize("text", [
    "fp32:", "fp32:..x", "floor:n:exp=1", "clamp:x", "eps:=1", "clip=-1", "lr=3",
    "init-scale=nan", "growth-interval=2.5", "fp32-master=1",
])
def test_bad_specs_are_one_line_errors(text):
    with pytest.raises(NanhuntError) as info:
        parse_fix(text)
    assert "\n" not in str(info.value)


def test_snippets_parse_and_are_short():
    import ast

    ctx = SnippetContext(device="cpu", scaler=True)
    for text in ["fp32:a.*.wo..norm", "clamp:a=1", "eps:n=1e-05", "opt-eps=0.0001",
                 "init-scale=1024", "clip=1", "lr-factor=0.1", "fp32-master",
                 "floor:n:sqrt=6.1e-05"]:
        snip = snippet([parse_fix(text)], ctx)
        ast.parse(snip.code)
        ast.parse(snip.helper)
        assert len(snip.code.splitlines()) <= 8, snip.code


def test_lr_factor_acts_on_a_schedule_that_sets_absolute_values():
    # nanoGPT's loop sets param_group["lr"] = get_lr(it) before every step: the factor applied
    # when the optimizer was made was overwritten, and the run trained at the script's lr
    script = SCRIPTS / "lr_schedule_absolute.py"
    fixes = install([parse_fix("lr-factor=0.1")])
    try:
        installed = run_script(script, [])
    finally:
        fixes.uninstall()
    by_hand = run_script(script, ["--scale", "0.1"])
    plain = run_script(script, [])

    def losses(lines):
        return [ln.split(" lr ")[0] for ln in lines]

    assert losses(installed) == losses(by_hand)
    assert losses(installed) != losses(plain)
    # the script still sees the values it set (its own prints and checkpoints are unchanged)
    assert [ln.split(" lr ")[1] for ln in installed] == [ln.split(" lr ")[1] for ln in plain]
    assert any("sets the learning rate itself" in n for n in fixes.notes), fixes.notes


@pytest.mark.parametrize("factor", [None, "0.1"])
def test_each_step_records_the_lr_its_optimizer_stepped_with(factor):
    """The schedule sets the next value after printing, and under lr-factor the script gets its
    own value back after the step: the recorded lr is what the update used, which is the value
    the by-hand run (--scale) printed for that step."""
    import nanhunt

    script = SCRIPTS / "lr_schedule_absolute.py"
    fixes = install([parse_fix(f"lr-factor={factor}")]) if factor else None
    try:
        with nanhunt.watch() as hunt:
            run_script(script, [])
    finally:
        if fixes is not None:
            fixes.uninstall()
    by_hand = run_script(script, ["--scale", factor or "1.0"])
    used = [float(ln.split(" lr ")[1]) for ln in by_hand]
    assert [s.lr for s in hunt.steps] == used
