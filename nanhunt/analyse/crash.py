"""The script's exception, located: the user's line that raised it and the module running.

The CLI hands the exception the script crashed with to :func:`describe_crash`; the result is
``trace.crash``, which rules read (:mod:`nanhunt.causes`: GradScaler's order errors, a constant
beyond a float16 tensor's range). Only the traceback's frames are read; nothing is re-run.
"""

from __future__ import annotations

import ast
import linecache
import runpy
from pathlib import Path
from types import TracebackType
from typing import Any

from nanhunt._paths import PACKAGE_DIR
from nanhunt.trace import Crash

__all__ = ["describe_crash"]

_OURS = str(Path(PACKAGE_DIR).resolve())
_HIDDEN = (_OURS, str(Path(runpy.__file__).resolve()), "<")


def _library(fname: str) -> bool:
    """torch's, the standard library's and other installed packages' code: not the user's."""
    return "site-packages" in fname or "dist-packages" in fname or fname.startswith(_HIDDEN) \
        or "/lib/python3" in fname


def _frames(tb: TracebackType | None) -> list[Any]:
    out = []
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


def _numbers_named(line: str, scope: dict[str, Any]) -> dict[str, float]:
    """Variables (and ``self.x`` attributes) the line uses whose values are plain numbers."""
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return {}
    out: dict[str, float] = {}
    for node in ast.walk(tree):
        value: Any = None
        if isinstance(node, ast.Name):
            value = scope.get(node.id)
            key = node.id
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id == "self":
            value = getattr(scope.get("self"), node.attr, None)
            key = f"self.{node.attr}"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def describe_crash(exc: BaseException, names: dict[int, str] | None = None,
                   step: int | None = None) -> Crash:
    """``exc`` as a :class:`~nanhunt.trace.Crash`: its type and message, the innermost frame of
    the user's code, and (``names``: id(module) -> qualified name) the innermost module whose
    code was running."""
    message = str(exc).strip()
    crash = Crash(type=type(exc).__name__, message=message, step=step)
    tbs = _frames(exc.__traceback__)
    for tb in reversed(tbs):
        fname = tb.tb_frame.f_code.co_filename
        if not _library(fname):
            crash.source = f"{fname}:{tb.tb_lineno}"
            crash.source_line = linecache.getline(fname, tb.tb_lineno).strip() or None
            crash.values = _numbers_named(crash.source_line or "", tb.tb_frame.f_locals)
            break
    if names:
        for tb in reversed(tbs):
            owner = tb.tb_frame.f_locals.get("self")
            name = names.get(id(owner)) if owner is not None else None
            if name is not None:
                crash.module = name
                break
    return crash
