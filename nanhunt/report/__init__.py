"""Renderers: they read a :class:`~nanhunt.trace.Trace` and nothing else (no torch).

``render_terminal`` prints the rich report, ``render_html`` returns one self-contained page, and
``write_reports`` writes report.json / report.html / report.txt atomically into a folder.
"""

from __future__ import annotations

from nanhunt.report.files import atomic_write_bytes, atomic_write_text, render_text, write_reports
from nanhunt.report.html import render_html
from nanhunt.report.terminal import render_terminal

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "render_html",
    "render_terminal",
    "render_text",
    "write_reports",
]
