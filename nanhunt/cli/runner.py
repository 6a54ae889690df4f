"""Run a user's script or module in this process exactly as ``python script.py`` would."""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import os
import runpy
import sys
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from nanhunt._paths import PACKAGE_DIR
from nanhunt.errors import NanhuntError

__all__ = ["Outcome", "Target", "TargetMissing", "print_user_traceback", "run_callable",
           "run_target", "user_traceback_text"]

_PACKAGE_DIR = str(Path(PACKAGE_DIR).resolve())
_HIDDEN = (_PACKAGE_DIR, str(Path(runpy.__file__).resolve()), "<frozen runpy>")


@dataclass
class Target:
    """What to run: a script path or a module name, and its arguments."""

    script: str | None = None
    module: str | None = None
    args: list[str] = field(default_factory=list)

    @property
    def argv0(self) -> str:
        return self.script if self.script is not None else str(self.module)

    def check(self) -> None:
        if self.script is not None:
            path = Path(self.script)
            if not path.exists():
                raise NanhuntError(f"no such script: {self.script}")
            if path.is_dir() and not (path / "__main__.py").exists():
                raise NanhuntError(f"{self.script} is a folder with no __main__.py")
        elif self.module is not None:
            # a top-level lookup imports nothing of the user's; a dotted name is checked again
            # in run_target, where looking it up imports its packages as python -m does
            import importlib.util

            top = self.module.split(".")[0]
            if top and importlib.util.find_spec(top) is None:
                raise TargetMissing(f"no module named {top}")
            if "." not in self.module:
                _check_module(self.module)


class TargetMissing(NanhuntError):
    """The script or module to run does not exist (a usage error, not the script's crash)."""


def _check_module(name: str) -> None:
    """Raise a one-line NanhuntError where ``python -m name`` would say the module is missing.

    A dotted name imports its parent packages, as ``python -m`` does; call it from
    :func:`run_target` then, so that their code runs instrumented. An ImportError raised by the
    user's own code (a missing dependency) is theirs: it propagates and is reported as a crash.
    """
    import importlib.util

    if not name or name.startswith("."):
        raise TargetMissing(f"relative module names are not supported: {name!r}")
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (name == missing or name.startswith(missing + ".")):
            raise TargetMissing(f"no module named {missing}") from None
        raise
    if spec is None:
        raise TargetMissing(f"no module named {name}")
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        main = f"{name}.__main__"
        if importlib.util.find_spec(main) is None:
            raise TargetMissing(f"{name} is a package with no __main__")


@dataclass
class Outcome:
    """How the user's code ended."""

    status: str  # complete | stopped | crashed | interrupted | exited
    exit_code: int = 0  # the code the script itself asked for (sys.exit), else 0
    error: BaseException | None = None


def run_target(target: Target, stop_exc: type[BaseException] | tuple) -> Outcome:
    """Run the target as ``__main__``; never raises what the user's code raised."""
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [target.argv0, *target.args]
    try:
        if target.script is not None:
            sys.path[0] = str(Path(target.script).resolve().parent)
            if Path(target.script).is_file():
                _run_file(target.script)
            else:  # a folder or zip with a __main__.py
                runpy.run_path(target.script, run_name="__main__")
        else:
            sys.path[0] = os.getcwd()
            sys.argv[0] = "-m"  # runpy fills in the module's file
            _check_module(str(target.module))
            runpy.run_module(str(target.module), run_name="__main__", alter_sys=True)
    except TargetMissing:
        raise  # not the user's failure: one line, exit 2, no report
    except BaseException as exc:  # the user's crash is the main case, not ours to propagate
        return _outcome(exc, stop_exc)
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
    return Outcome("complete", 0, None)


def run_callable(fn: Any, args: tuple, stop_exc: type[BaseException] | tuple) -> Outcome:
    """Call ``fn(*args)`` (a worker's function) and say how it ended, as :func:`run_target`."""
    try:
        fn(*args)
    except BaseException as exc:
        return _outcome(exc, stop_exc)
    return Outcome("complete", 0, None)


def _outcome(exc: BaseException, stop_exc: type[BaseException] | tuple) -> Outcome:
    if isinstance(exc, stop_exc):
        return Outcome("stopped", 0, exc)
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        return Outcome("complete" if code == 0 else "exited", code, exc)
    if isinstance(exc, KeyboardInterrupt):
        return Outcome("interrupted", 130, exc)
    return Outcome("crashed", 1, exc)


def _run_file(script: str) -> None:
    """``python script.py``: the code runs as ``__main__`` in a fresh module, compiled under
    the path python gives it (absolute since Python 3.9: the working folder joined to the
    path as typed, not normalised), which ``__file__``, warnings and tracebacks show, while
    ``sys.argv[0]`` stays as typed (``runpy.run_path`` would set both to the same path)."""
    path = script if os.path.isabs(script) else os.path.join(os.getcwd(), script)
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path),
                         __builtins__=builtins)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main  # pickle finds the script's classes as python would
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _user_frames(tb: TracebackType | None) -> list[traceback.FrameSummary]:
    return [f for f in traceback.extract_tb(tb) if not f.filename.startswith(_HIDDEN)]


def print_user_traceback(exc: BaseException, file=None) -> None:
    """Print the exception as Python would, without nanhunt's or runpy's frames."""
    file = file or sys.stderr
    file.write(user_traceback_text(exc))


def user_traceback_text(exc: BaseException, head: list | None = None) -> str:
    """The exception as Python formats it, without nanhunt's or runpy's frames; ``head``
    (frame summaries) goes above the outermost exception's own frames (the caller's frame, as
    ``traceback.format_exc()`` in that caller would show it)."""
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__, compact=True)
    seen = set()
    node: traceback.TracebackException | None = te
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        frames = [f for f in node.stack if not f.filename.startswith(_HIDDEN)]
        if node is te and head:
            frames = [*head, *frames]
        node.stack = traceback.StackSummary.from_list(frames)
        node = node.__cause__ or node.__context__
    return "".join(te.format())
