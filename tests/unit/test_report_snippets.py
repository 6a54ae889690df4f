"""Code snippets are shown whole: never wrapped or cropped, in the terminal at 80 columns and in
report.txt, so that what the user copies is what parses."""

from __future__ import annotations

import ast
import io
import re
import textwrap

import pytest
from rich.console import Console

from nanhunt.report import render_terminal
from nanhunt.report._example import example_trace
from nanhunt.report.files import render_text
from nanhunt.trace import Recommendation, Trace

# lines wider than any view, with strings and nested calls (where hard wrapping breaks code)
LONG = "\n".join([
    "import torch",
    'scaler = torch.amp.GradScaler("cuda", init_scale=4096.0, growth_interval=2000, '
    "backoff_factor=0.5)",
    'with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=False):  '
    '# "keep fp32 here, please"',
    "    logits = model.encoder.blocks[1].ffn.wo(hidden_states.float()).clamp(min=-65504.0, "
    "max=65504.0)",
]) + "\n"


def shown_snippets(text: str) -> list[str]:
    """The code blocks of the Recommendations section, as a user selects and copies them: each
    recommendation is a heading ("1. type ..."), its status and evidence lines, a blank line,
    then the code up to the next heading or section."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Recommendations "))
    end = next((i for i in range(start + 1, len(lines)) if "────" in lines[i]), len(lines))
    chunks: list[list[str]] = []
    for line in lines[start + 1:end]:
        if re.match(r"\d+\. \w", line):
            chunks.append([])
        elif chunks:
            chunks[-1].append(line)
    blocks = []
    for chunk in chunks:
        if "" not in chunk:
            continue
        rest = chunk[chunk.index("") + 1:]
        if rest and rest[0].strip().startswith(("nanhunt diagnose ", "needs a code change")):
            rest = rest[2:]  # the --fix command line (or why there is none), then a blank line
        code = "\n".join(rest).rstrip()
        if code:
            blocks.append(textwrap.dedent(code))
    return blocks


def _trace() -> Trace:
    trace = example_trace()
    trace.recommendations.append(Recommendation("fp32_module", "x", LONG, module="m"))
    return trace


def _terminal(trace: Trace, width: int) -> str:
    out = io.StringIO()
    render_terminal(trace, Console(file=out, width=width, color_system=None))
    return out.getvalue()


@pytest.mark.parametrize("view", ["terminal-80", "terminal-60", "report.txt"])
def test_every_snippet_is_shown_whole_and_parses(view):
    trace = _trace()
    assert max(len(ln) for ln in LONG.splitlines()) > 100  # wider than the view
    text = render_text(trace) if view == "report.txt" else _terminal(trace, int(view[-2:]))
    snippets = [r.snippet.rstrip() for r in trace.recommendations if r.snippet]
    assert len(snippets) >= 3
    shown = shown_snippets(text)
    for block in shown:
        ast.parse(block)  # what the user copies is valid Python
    assert shown == snippets


def test_snippet_keeps_its_colours_at_a_terminal():
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system="standard")
    render_terminal(_trace(), console)
    assert "\x1b[" in out.getvalue()  # highlighted, and still whole:
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())
    assert [b.rstrip() for b in shown_snippets(plain)] == [r.snippet.rstrip() for r in
                                                          _trace().recommendations]
