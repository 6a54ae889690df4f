"""The live status line at a terminal, drawn only below whole lines of the script's output.

The script's own text must reach the terminal unchanged and must never be overwritten. So while
the live line runs, ``sys.stdout`` and ``sys.stderr`` (when they are the terminal) are wrapped:
before the script writes, the live line is erased (``\\r`` + clear-line, on the line the live line
sits on, which holds nothing of the script's); the script's text is written as it is; the live
line is drawn again only once the script's output ends with a newline. While the script has a
partial line open (``print(..., end="")``, a tqdm bar redrawn with ``\\r``) the live line waits,
so the partial line is never cleared. On a pipe nothing is wrapped and nothing is drawn.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

__all__ = ["LiveLine"]

_CLEAR = "\r\x1b[2K"


class LiveLine:
    """One status line on stderr: ``nanhunt  step N  loss …  scale …  skipped K``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and _isatty(sys.stderr)
        self.text = ""
        self._last = 0.0
        self._drawn = False  # the live line is on the screen now, on the cursor's row
        self._watched: list[_Watched] = []
        self._out: Any = sys.stderr  # the terminal stream the live line is drawn on
        self._saved: tuple[Any, Any] | None = None

    # ------------------------------------------------------------------ status

    def update(self, rec: Any, hunt: Any) -> None:
        if not self.enabled:
            return
        skipped = sum(1 for s in hunt.steps if s.skipped)
        parts = [f"nanhunt  step {rec.index}"]
        if rec.loss is not None:
            parts.append(f"loss {rec.loss:.4g}")
        if rec.scale is not None:
            parts.append(f"scale {rec.scale:g}")
        parts.append(f"skipped {skipped}")
        if hunt.first_failure is not None:
            parts.append("FAILURE FOUND")
        self.text = "  ".join(parts)
        now = time.monotonic()
        if now - self._last > 0.1 or hunt.first_failure is not None:
            self._last = now
            self.draw()

    def draw(self) -> None:
        if not self.enabled or not self.text or any(w.partial for w in self._watched):
            return  # a line of the script's is open: drawing now would split or erase it
        self._flush_script_streams()  # the script's buffered text lands above, not after, it
        self._out.write(_CLEAR + self.text[: _columns(self._out) - 1])
        self._out.flush()
        self._drawn = True

    def erase(self) -> None:
        if self._drawn:
            self._out.write(_CLEAR)
            self._out.flush()
            self._drawn = False

    # ------------------------------------------------------------------ the script's writes

    def before_write(self) -> None:
        self.erase()

    def after_write(self) -> None:
        if self.text:
            self.draw()

    def _flush_script_streams(self) -> None:
        for stream in self._saved or ():
            with contextlib.suppress(OSError, ValueError):
                stream.flush()

    # ------------------------------------------------------------------ context

    def __enter__(self) -> LiveLine:
        if not self.enabled:
            return self
        self._out = sys.stderr
        self._saved = (sys.stdout, sys.stderr)
        if _isatty(sys.stdout):
            sys.stdout = _Watched(sys.stdout, self)
            self._watched.append(sys.stdout)
        sys.stderr = _Watched(sys.stderr, self)
        self._watched.append(sys.stderr)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            out, err = self._saved
            # put back what we replaced; a stream the script replaced in turn is its own
            if isinstance(sys.stdout, _Watched) and sys.stdout._line is self:
                sys.stdout = out
            if isinstance(sys.stderr, _Watched) and sys.stderr._line is self:
                sys.stderr = err
            self._flush_script_streams()
        self.erase()
        self._saved = None
        self._watched = []


class _Watched:
    """A terminal stream of the script's: the text goes through unchanged, the live line is
    erased before it and drawn again after a whole line."""

    def __init__(self, inner: Any, line: LiveLine) -> None:
        self._inner, self._line = inner, line
        self.partial = False  # this stream's last text left its line open

    def write(self, s: str) -> int:
        if not s:
            return self._inner.write(s)
        self._line.before_write()
        n = self._inner.write(s)
        self.partial = not s.endswith("\n")
        self._line.after_write()
        return n

    def writelines(self, lines: Any) -> None:
        for s in lines:
            self.write(s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __iter__(self) -> Any:
        return iter(self._inner)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def _columns(stream: Any) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 80
