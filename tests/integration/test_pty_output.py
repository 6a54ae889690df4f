"""At a real terminal (a pseudo-terminal, not a pipe) the live status line never overwrites the
script's own output, and on a pipe nanhunt adds nothing to the script's bytes."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pyte = pytest.importorskip("pyte")  # a small VT100 emulator: what the user's screen shows

ENV = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="100", LINES="60", TERM="xterm")
ENV.pop("PYTHONUNBUFFERED", None)  # a terminal's own buffering, as a user has it

# Prints in every way a training script does, between steps slow enough for the live line to be
# drawn in between: print, stderr, end="", a tqdm-like \r bar, the logging module.
SCRIPT = textwrap.dedent("""
    import logging, sys, time
    import torch
    from torch import nn
    logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(message)s")
    log = logging.getLogger("train")
    torch.manual_seed(0)
    model = {model}
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    print("starting", flush=True)
    for step in range(6):
        opt.zero_grad()
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        time.sleep(0.12)
        print(f"step {{step}} loss {{loss.item():.4f}}")
        log.info("logged step %d", step)
        print("partial", end="", flush=True)
        time.sleep(0.12)
        print(" line done")
        print("to stderr %d" % step, file=sys.stderr)
        for k in range(1, 4):
            sys.stderr.write(f"\\rbar {{step}}: {{k}}/3")
            sys.stderr.flush()
            time.sleep(0.05)
        sys.stderr.write("\\n")
    print("the end")
""")

MODELS = {
    "mlp": "nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))",
    "rnn": "type('R', (nn.Module,), {'__init__': lambda s: (nn.Module.__init__(s), "
           "setattr(s, 'rnn', nn.GRU(16, 8, batch_first=True)), "
           "setattr(s, 'head', nn.Linear(8, 1)))[0], "
           "'forward': lambda s, x: s.head(s.rnn(x.unsqueeze(1))[0][:, -1])})()",
}


def _expected_lines(loss_lines: list[str]) -> list[str]:
    lines = ["starting"]
    for step, loss_line in enumerate(loss_lines):
        lines += [loss_line, f"LOG INFO logged step {step}", "partial line done",
                  f"to stderr {step}", f"bar {step}: 3/3"]
    return [*lines, "the end"]


def _run_in_pty(cmd: list[str], cwd: Path) -> bytes:
    """Run cmd with stdin, stdout and stderr on one pseudo-terminal; return what it wrote."""
    master, slave = os.openpty()
    os.set_blocking(master, False)
    import fcntl
    import struct
    import termios

    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 100, 0, 0))
    proc = subprocess.Popen(cmd, cwd=cwd, env=ENV, stdin=slave, stdout=slave, stderr=slave,
                            close_fds=True, start_new_session=True)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    return bytes(out)


def _screen(data: bytes) -> list[str]:
    screen = pyte.Screen(100, 400)
    stream = pyte.ByteStream(screen)
    stream.feed(data.replace(b"\n", b"\r\n") if b"\r\n" not in data else data)
    return [line.rstrip() for line in screen.display]


_LIVE = re.compile(rb"\r\x1b\[2K(nanhunt  step[^\r\n\x1b]*)?")


def _script(cwd: Path, model: str) -> Path:
    script = cwd / "train.py"
    script.write_text(SCRIPT.format(model=MODELS[model]))
    return script


def _in_pty(cwd: Path, model: str, ours: bool) -> bytes:
    script = _script(cwd, model)
    cmd = [sys.executable, "-m", "nanhunt", "diagnose", str(script)] if ours else \
        [sys.executable, str(script)]
    return _run_in_pty(cmd, cwd)


def _on_pipe(cwd: Path, model: str, ours: bool) -> subprocess.CompletedProcess:
    script = _script(cwd, model)
    cmd = [sys.executable, "-m", "nanhunt", "diagnose", str(script)] if ours else \
        [sys.executable, str(script)]
    return subprocess.run(cmd, cwd=cwd, env=dict(ENV), capture_output=True, timeout=240)


#: the MLP in the default suite; the recurrent model (a second architecture through the same
#: output path, four more Python starts) with ``-m slow``
DEFAULT = ("mlp",)


def _submit(cli, model: str, where: str, ours: bool):
    return cli.call(("pty-output", model, where, ours),
                    lambda cwd: (_in_pty if where == "pty" else _on_pipe)(cwd, model, ours))


def prefetch(cli, models=DEFAULT) -> dict:
    """Per model, the script under nanhunt and under plain python at a terminal, in the
    session's shared pool (tests/integration/conftest.py; started when collection ends), each
    in a fresh folder: they mostly sleep between steps, so they overlap well. (The pipe pair,
    for the -m slow test, is submitted when that test asks for it.)"""
    return {(model, "pty", ours): _submit(cli, model, "pty", ours)
            for model in models for ours in (True, False)}


@pytest.fixture(scope="module", params=[
    pytest.param(m, marks=() if m in DEFAULT else pytest.mark.slow) for m in sorted(MODELS)])
def runs(request, cli):
    prefetch(cli, (request.param,))

    class Runs:
        def __getitem__(self, key: tuple[str, bool]):
            return _submit(cli, request.param, *key).result()

    return Runs()


def test_every_line_the_script_printed_is_intact_on_the_screen(runs):
    ours, plain = runs["pty", True], runs["pty", False]
    plain_screen = _screen(plain)
    loss_lines = [ln for ln in plain_screen if ln.startswith("step ")]
    expected = _expected_lines(loss_lines)
    assert [ln for ln in plain_screen if ln] == expected  # the reference: python script.py
    screen = _screen(ours)
    assert b"nanhunt  step" in ours  # the live line was drawn, so the test means something
    shown = [ln for ln in screen if ln]
    # the script's lines, in order and unbroken, come before nanhunt's summary
    assert shown[: len(expected)] == expected, "\n".join(shown[: len(expected) + 5])


def test_the_scripts_bytes_reach_the_terminal_unchanged(runs):
    ours, plain = runs["pty", True], runs["pty", False]
    script_part = _LIVE.sub(b"", ours)
    end = script_part.index(b"the end") + len(b"the end\r\n")
    assert script_part[:end] == plain[: plain.index(b"the end") + len(b"the end\r\n")]


@pytest.mark.slow  # (stdout on a pipe is compared with python's in test_cli.py too)
def test_output_on_a_pipe_is_byte_identical_to_python(runs):
    ours, plain = runs["pipe", True], runs["pipe", False]
    assert ours.returncode == 0, ours.stderr.decode()
    assert ours.stdout == plain.stdout
    assert ours.stderr.startswith(plain.stderr)  # then nanhunt's summary, after the script
