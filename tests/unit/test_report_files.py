"""Writing report files: all three formats, atomically, with no temp files left behind."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nanhunt.errors import NanhuntError
from nanhunt.report import atomic_write_bytes, atomic_write_text, write_reports
from nanhunt.report._example import example_trace
from nanhunt.trace import Trace


def test_writes_json_html_and_text(tmp_path: Path):
    trace = example_trace()
    out = tmp_path / "nested" / "reports"
    paths = write_reports(trace, out)
    assert paths == {
        "json": out / "report.json",
        "html": out / "report.html",
        "txt": out / "report.txt",
    }
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "report.json", "report.txt"]
    loaded = Trace.from_json(paths["json"].read_text(encoding="utf-8"))
    assert loaded.to_dict() == trace.to_dict()
    assert paths["html"].read_text(encoding="utf-8").startswith("<!doctype html>")
    text = paths["txt"].read_text(encoding="utf-8")
    assert "PROBLEM: overflow in forward at step 3, module encoder.blocks.1.ffn.wo" in text
    assert "\x1b" not in text
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "(use --all)" not in text  # a file has nowhere to pass --all: it lists everything


def test_only_the_requested_formats(tmp_path: Path):
    paths = write_reports(Trace(), tmp_path, formats=["json"])
    assert list(paths) == ["json"]
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_unknown_format_is_a_nanhunt_error(tmp_path: Path):
    with pytest.raises(NanhuntError, match="unknown report format 'pdf'"):
        write_reports(Trace(), tmp_path, formats=("json", "pdf"))
    assert list(tmp_path.iterdir()) == []


def test_out_dir_that_is_a_file(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(NanhuntError, match="cannot create report folder"):
        write_reports(Trace(), blocker)


def test_rewrite_replaces_content_and_leaves_no_temp_files(tmp_path: Path):
    target = tmp_path / "report.txt"
    atomic_write_text(target, "old")
    assert atomic_write_text(target, "new ✓") == target
    assert target.read_text(encoding="utf-8") == "new ✓"
    atomic_write_bytes(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert [p.name for p in tmp_path.iterdir()] == ["report.txt"]


def test_file_mode_follows_umask(tmp_path: Path):
    old = os.umask(0o027)
    try:
        path = atomic_write_text(tmp_path / "r.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_failure_during_write_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
):
    target = tmp_path / "report.json"
    target.write_text("old report", encoding="utf-8")

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, boom)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_text(target, "new report")
    monkeypatch.undo()
    assert target.read_text(encoding="utf-8") == "old report"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_write_reports_failure_keeps_the_old_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    paths = write_reports(example_trace(), tmp_path)
    before = {k: p.read_bytes() for k, p in paths.items()}
    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _FailingFile(fd))
    with pytest.raises(NanhuntError, match=r"cannot write .*report.json: Input/output error"):
        write_reports(Trace(), tmp_path)
    monkeypatch.undo()
    assert {k: p.read_bytes() for k, p in paths.items()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths.values())


class _FailingFile:
    """A file whose write fails, as on a full or broken disk; closes the descriptor it owns."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        os.close(self.fd)
        return False

    def write(self, data):
        raise OSError(5, "Input/output error")
