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


def test_replay_of_a_missing_snapshot_is_one_line_before_torch_loads(tmp_path):
    import subprocess
    import sys

    (tmp_path / "snapshot.pt").mkdir()  # a folder is no snapshot either
    (tmp_path / "snap.pt").write_bytes(b"")
    code = ("import sys\nfrom nanhunt.cli import main\n"
            "codes = [main(['replay', 'missing.pt']), main(['replay', 'snapshot.pt']),\n"
            "         main(['replay', 'snap.pt', '--script', 'gone.py'])]\n"
            "print(codes, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "[2, 2, 2] False", out.stderr
    assert out.stderr.splitlines() == [
        "nanhunt: no such snapshot: missing.pt",
        "nanhunt: snapshot.pt is not a file",
        "nanhunt: no such script: gone.py",
    ]
