from __future__ import annotations

import pytest

from nanhunt.cli.main import main, split_argv
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
