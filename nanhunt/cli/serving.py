"""Fork servers: a process that imports torch and nanhunt once, then forks a fresh child for each
re-run (``python -m nanhunt.cli.forkserver`` runs :func:`serve`; :class:`Zygote` is one forked
from ``nanhunt diagnose`` itself). This module never imports the CLI: the caller passes what a
child runs (``run(argv) -> exit status``, ``nanhunt.cli.main.rerun``).


Importing torch (and the ``torch._dynamo`` that the first optimizer pulls in) costs more than a
small script's training steps; re-run verification runs the script up to ``--verify N`` times,
so it starts this server once (``python -m nanhunt.cli.forkserver``, single-threaded after its
imports, so forking is safe) and asks it for each re-run; the test suite runs its CLI tests
through it too. Protocol, one JSON line each way: ``{"ready"}`` once its imports are done, then
for each request ``{"argv", "cwd", "env", "log"}`` the answers ``{"pid"}`` (forked) and
``{"pid", "code"}`` (the child's exit status). The child is ``nanhunt ARGV`` as
``python -m nanhunt`` run in ``cwd`` would be, with its stdout and stderr in ``log`` (or apart,
in ``stdout`` and ``stderr``; with ``session``, in a process group of its own; with
``python``, ``python ARGV`` instead, a plain script, for the tests' references). The server
ignores Ctrl-C (the child, in the same process group, gets it and writes its report).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nanhunt._waiting import PollWait

__all__ = ["Zygote", "serve", "zygotes"]

Run = Callable[[list[str]], int]


def _child(request: dict, run: Run) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request.get("session"):  # a process group of its own: killed whole on a timeout
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    out = request.get("stdout", request.get("log"))
    err = request.get("stderr", out)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    out_fd = os.open(out, flags, 0o644)
    err_fd = out_fd if err == out else os.open(err, flags, 0o644)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    if request.get("python"):  # a plain script, as ``python SCRIPT ARGS`` runs it
        script = os.path.abspath(request["argv"][0])
        sys.argv = list(request["argv"])
        if sys.path:
            sys.path[0] = os.path.dirname(script)
    else:  # as ``python -m nanhunt`` from that folder would have them
        sys.argv = [str(Path(__file__).resolve().parents[1] / "__main__.py"), *request["argv"]]
        if sys.path:
            sys.path[0] = os.getcwd()
    try:
        if request.get("python"):
            import runpy

            runpy.run_path(script, run_name="__main__")
            return 0
        return run(request["argv"])
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if not isinstance(exc.code, int):  # sys.exit("message"): printed, status 1
            print(exc.code, file=sys.stderr)
            return 1
        return exc.code
    except KeyboardInterrupt:
        _print_exception(request)
        return 130
    except BaseException:
        _print_exception(request)
        # a plain script's uncaught exception exits 1, as python's does; nanhunt's own is 3
        return 1 if request.get("python") else 3
    finally:
        if request.get("python"):  # as python exits: the script's atexit functions run
            import atexit

            with contextlib.suppress(BaseException):
                atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def _print_exception(request: dict) -> None:
    if request.get("python"):  # through the script's own sys.excepthook, as python does
        with contextlib.suppress(BaseException):
            sys.excepthook(*sys.exc_info())
            return
    traceback.print_exc()


#: what every re-run would import again; the first optimizer imports torch._dynamo
_PRELOAD = ("torch", "torch._dynamo", "nanhunt.cli.main", "nanhunt.experiment.fixes",
            "nanhunt.pipeline", "nanhunt.experiment.sandbox")


def serve(run: Run, inp: Any = None, out: Any = None) -> None:
    """Answer requests from ``inp`` (default stdin) on ``out`` (default stdout) until EOF, each
    child running ``run(argv)`` (or, with ``python``, a plain script)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in _PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    inp = inp if inp is not None else sys.stdin
    out = out if out is not None else sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in inp:
        request = json.loads(line)
        out.flush()
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                code = _child(request, run)
            finally:
                os._exit(code if isinstance(code, int) else 1)
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()


# ----------------------------------------------------------------------------- zygotes


class Zygote(PollWait):
    """A fork server forked from ``nanhunt diagnose`` itself before the user's script starts
    (torch and nanhunt already imported, nothing of the script's yet), so that re-run
    verification pays no Python start and no torch import: the subset of ``subprocess.Popen``
    that re-run verification uses (``stdin``, ``stdout``, ``poll``, ``wait``, ``kill``). It
    reads requests from a pipe and ends when the pipe closes (``nanhunt`` exited or
    :meth:`close`)."""

    what = "zygote"

    def __init__(self, run: Run) -> None:
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the zygote: nothing of the parent's but the imports and these pipes
            code = 0
            try:
                os.close(req_w)
                os.close(ans_r)
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                keep = {0, 1, 2, req_r, ans_w}
                for name in os.listdir("/proc/self/fd"):  # a terminal, the caller's pipes
                    if name.isdigit() and int(name) not in keep:
                        with contextlib.suppress(OSError):
                            os.close(int(name))
                serve(run, os.fdopen(req_r, "r"), os.fdopen(ans_w, "w"))
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(req_r)
        os.close(ans_w)
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = os.fdopen(req_w, "w", buffering=1)
        self.stdout = os.fdopen(ans_r, "r")

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        for f in (self.stdin, self.stdout):
            with contextlib.suppress(OSError):
                f.close()
        try:
            self.wait(timeout=5)
        except Exception:
            self.kill()
            self.wait()


def zygotes(n: int, run: Run) -> list[Zygote]:
    """``n`` zygotes, or none where forking a process that imported torch is not safe (only
    Linux forks here, and never once CUDA started in this process; otherwise each slot starts
    ``python -m nanhunt.cli.forkserver``). Not yet run on a GPU machine."""
    if not sys.platform.startswith("linux") or n < 1:
        return []
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return []  # CUDA cannot be used again in a process forked after it started
    made = []
    with contextlib.suppress(OSError):
        for _ in range(n):
            made.append(Zygote(run))
    return made

