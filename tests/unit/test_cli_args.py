from __future__ import annotations

import pytest

from nanhunt.cli import main, split_argv
from nanhunt.errors import NanhuntError


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train.py"], ([], "train.py", None, [])),
        (["--out", "r", "train.py", "--out", "s"], (["--out", "r"], "train.py", None,
                                                   ["--out", "s"])),
        (["--keep-going", "t.py", "--", "-x"], (["--keep-going"], "t.py", None, ["--", "-x"])),
        (["--", "t.py", "a"], ([], "t.py", None, ["a"])),
        (["-m", "pkg.mod", "--lr", "1"], ([], None, "pkg.mod", ["--lr", "1"])),
        (["--target=bfloat16", "-mpkg"], (["--target=bfloat16"], None, "pkg", [])),
        (["--strict"], (["--strict"], None, None, [])),
    ],
)
def test_split_argv(argv, expected):
    assert split_argv(argv) == expected


def test_option_missing_value():
    with pytest.raises(NanhuntError, match="--out needs a value"):
        split_argv(["--out"])


def test_main_returns_2_on_usage_errors(capsys):
    assert main(["diagnose"]) == 2
    assert capsys.readouterr().err.startswith("nanhunt: no script given")
    assert main(["report", "/nonexistent/report.json"]) == 2
    assert main([]) == 2
    assert main(["--version"]) == 0


class _FakeTTY:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.parts.append(s)
        return len(s)

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        raise OSError


def test_live_line_clears_itself_around_the_scripts_prints(monkeypatch):
    from nanhunt.cli import _LiveLine
    from nanhunt.trace import StepRecord

    err, out = _FakeTTY(), _FakeTTY()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr("sys.stdout", out)

    class FakeHunt:
        steps = [StepRecord(0, skipped=True), StepRecord(1)]
        first_failure = None

    import sys

    with _LiveLine(enabled=True) as live:
        live.update(StepRecord(1, loss=0.5, scale=32768.0), FakeHunt())
        assert "step 1" in err.parts[-1] and "scale 32768" in err.parts[-1]
        assert "skipped 1" in err.parts[-1]
        print("epoch done")  # the script's own line
        assert out.parts[0] == "epoch done"
        assert err.parts[-2] == "\r\x1b[2K"  # cleared before the script wrote
        assert "step 1" in err.parts[-1]  # and drawn again after its newline
    assert sys.stdout is out
    assert err.parts[-1] == "\r\x1b[2K"


def test_live_line_is_silent_when_stderr_is_not_a_terminal(capsys):
    from nanhunt.cli import _LiveLine
    from nanhunt.trace import StepRecord

    line = _LiveLine(enabled=True)
    line.update(StepRecord(0, loss=1.0), type("H", (), {"steps": [], "first_failure": None}))
    assert capsys.readouterr().err == ""
