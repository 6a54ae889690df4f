"""Writing report files atomically: a reader (or a crash) never sees half a report.

Each file is written to a temporary file in the same directory, flushed and fsynced, then moved
over the destination with :func:`os.replace`, which is atomic on POSIX and Windows.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console

from nanhunt.errors import NanhuntError
from nanhunt.report.html import render_html
from nanhunt.report.terminal import render_terminal
from nanhunt.trace import Trace

__all__ = [
    "REPORT_FORMATS",
    "atomic_write_bytes",
    "atomic_write_text",
    "render_text",
    "write_reports",
]

#: Report formats and their file names inside the output folder.
REPORT_FORMATS = {"json": "report.json", "html": "report.html", "txt": "report.txt"}

#: Width of the plain-text report (report.txt).
TEXT_WIDTH = 100


def _current_umask() -> int:
    # os.umask can only be read by setting it; restore at once (done per write, not at import,
    # so a umask the user's script sets later is honoured).
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that ``path`` holds either the old or the new content.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.txt"
    >>> atomic_write_bytes(p, b"hello").read_bytes()
    b'hello'
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; give the report the permissions an ordinary open() would
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """:func:`atomic_write_bytes` for text (UTF-8, newlines written as given)."""
    return atomic_write_bytes(path, text.encode(encoding))


def _fsync_dir(directory: Path) -> None:
    # makes the rename itself durable; not possible on every platform, so best effort
    if not hasattr(os, "O_DIRECTORY"):
        return
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def render_text(trace: Trace, width: int = TEXT_WIDTH, *, show_all: bool = True) -> str:
    """The terminal report as plain text (no colour, no control codes)."""
    buf = io.StringIO()
    console = Console(
        file=buf,
        width=width,
        color_system=None,
        force_terminal=False,
        force_jupyter=False,
        legacy_windows=False,
        emoji=False,
        highlight=False,
    )
    render_terminal(trace, console, show_all=show_all)
    # rich pads lines to the console width; a file does not need the trailing blanks
    return "".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines())


def write_reports(
    trace: Trace, out_dir: str | Path, *, formats: Iterable[str] = ("json", "html", "txt")
) -> dict[str, Path]:
    """Write ``report.json``, ``report.html`` and ``report.txt`` for ``trace`` into ``out_dir``.

    Creates ``out_dir`` if needed and returns ``{format: path}`` for the files written.

    >>> import tempfile
    >>> sorted(write_reports(Trace(), tempfile.mkdtemp()))
    ['html', 'json', 'txt']
    """
    formats = list(dict.fromkeys(formats))
    unknown = [f for f in formats if f not in REPORT_FORMATS]
    if unknown:
        raise NanhuntError(
            f"unknown report format {unknown[0]!r} (choose from {', '.join(REPORT_FORMATS)})"
        )
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NanhuntError(f"cannot create report folder {out}: {exc.strerror}") from None
    renderers = {
        "json": lambda: trace.to_json() + "\n",
        "html": lambda: render_html(trace),
        "txt": lambda: render_text(trace),
    }
    written: dict[str, Path] = {}
    for name in formats:
        path = out / REPORT_FORMATS[name]
        try:
            written[name] = atomic_write_text(path, renderers[name]())
        except OSError as exc:
            raise NanhuntError(f"cannot write {path}: {exc.strerror or exc}") from None
    return written
