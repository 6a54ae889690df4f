"""The live line's writes, in order, around the script's own writes on one terminal."""

from __future__ import annotations

import sys

import pytest

from nanhunt.cli.live import LiveLine
from nanhunt.trace import StepRecord

CLEAR = "\r\x1b[2K"


class _Terminal:
    """stdout and stderr of one terminal: every write, in order, with the stream it came from."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str]] = []

    def stream(self, name: str) -> _Stream:
        return _Stream(self, name)


class _Stream:
    def __init__(self, term: _Terminal, name: str) -> None:
        self.term, self.name = term, name

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.term.writes.append((self.name, s))
        return len(s)

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        raise OSError


class _Hunt:
    steps = [StepRecord(0, skipped=True), StepRecord(1)]
    first_failure = None


@pytest.fixture
def term(monkeypatch):
    """Call it in the test body: pytest puts its own capture back between setup and call."""
    def install() -> _Terminal:
        t = _Terminal()
        monkeypatch.setattr("sys.stdout", t.stream("out"))
        monkeypatch.setattr("sys.stderr", t.stream("err"))
        return t

    return install


def _draws(term: _Terminal) -> list[int]:
    return [i for i, (_n, s) in enumerate(term.writes) if s.startswith(CLEAR + "nanhunt")]


def _update(live: LiveLine, step: int) -> None:
    live._last = 0.0  # no throttling in the test
    live.update(StepRecord(step, loss=0.5, scale=32768.0), _Hunt())


def test_status_text(term):
    term = term()
    with LiveLine(enabled=True) as live:
        _update(live, 1)
    text = term.writes[0][1]
    assert "step 1" in text and "loss 0.5" in text and "scale 32768" in text
    assert "skipped 1" in text


def test_whole_lines_go_above_the_live_line(term):
    term = term()
    out, err = sys.stdout, sys.stderr
    with LiveLine(enabled=True) as live:
        _update(live, 1)
        print("epoch done")  # print writes the text, then the newline
        assert term.writes[1] == ("err", CLEAR)  # erased before the script's text
        assert term.writes[2:4] == [("out", "epoch done"), ("out", "\n")]
        assert _draws(term)[-1] == 4  # drawn again only after the newline
        print("warning", file=sys.stderr)
        assert ("err", "warning") in term.writes
    assert sys.stdout is out and sys.stderr is err
    assert term.writes[-1] == ("err", CLEAR)


def test_an_open_line_is_never_cleared(term):
    term = term()
    with LiveLine(enabled=True) as live:
        print("partial", end="")
        _update(live, 1)
        sys.stderr.write("\rbar 1/3")  # a tqdm-like bar on the other stream
        _update(live, 2)
        assert _draws(term) == []  # nothing drawn, nothing cleared, while a line is open
        assert ("err", CLEAR) not in term.writes
        sys.stderr.write("\n")
        assert _draws(term) == []  # stdout's line is still open
        print(" done")
        assert _draws(term) and _draws(term)[-1] == len(term.writes) - 1
    script = "".join(s for _n, s in term.writes if not s.startswith(CLEAR))
    assert script == "partial\rbar 1/3\n done\n"


def test_live_line_is_silent_when_stderr_is_not_a_terminal(capsys):
    line = LiveLine(enabled=True)
    with line:
        line.update(StepRecord(0, loss=1.0), _Hunt())
    assert capsys.readouterr().err == ""
