"""``python -m nanhunt`` for the tests, through nanhunt's fork server (see
tests/integration/conftest.py's docstring): importable by every test module (``from clirun
import run_nanhunt``: pytest puts tests/ on sys.path for tests/conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = ["FORK", "MODULE", "cli_env", "close_fork_servers", "interruptible", "run_nanhunt",
           "run_python"]


def cli_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)


MODULE = (sys.executable, "-m", "nanhunt")  # the launcher the fork server stands in for
FORK = os.environ.get("NANHUNT_TEST_FORK", "1") != "0" and hasattr(os, "fork")


class _ForkServer:
    """One ``python -m nanhunt.cli.forkserver`` (torch and nanhunt imported once); its requests
    one at a time, so each thread of this process has its own."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="nanhunt-fork-"))
        self.count = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanhunt.cli.forkserver"], cwd=self.tmp, env=cli_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, bufsize=1)
        if not self.proc.stdout.readline():
            raise RuntimeError("the fork server did not start")

    def run(self, args: Sequence[str], cwd: Path, env: dict[str, str],
            timeout: float, python: bool = False) -> subprocess.CompletedProcess:
        self.count += 1
        out, err = self.tmp / f"{self.count}.out", self.tmp / f"{self.count}.err"
        request = {"argv": list(args), "cwd": str(cwd), "env": env, "stdout": str(out),
                   "stderr": str(err), "session": True, "python": python}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = int(json.loads(self.proc.stdout.readline())["pid"])
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        timed_out = not ready
        if timed_out:  # as subprocess.run(timeout=) does: kill it (its whole group), then raise
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fork server died")
        code = int(json.loads(line)["code"])
        stdout, stderr = (f.read_text(errors="replace") for f in (out, err))
        out.unlink()
        err.unlink()
        cmd = [sys.executable, *args] if python else [*MODULE, *args]
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, code, stdout, stderr)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


_servers = threading.local()
_all_servers: list[_ForkServer] = []
_servers_lock = threading.Lock()


def _server() -> _ForkServer:
    server = getattr(_servers, "server", None)
    if server is None or server.proc.poll() is not None:
        server = _servers.server = _ForkServer()
        with _servers_lock:
            _all_servers.append(server)
    return server


def run_nanhunt(args: Sequence[str | Path], cwd: Path, *, env: dict[str, str] | None = None,
                timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m nanhunt ARGS`` in ``cwd`` with ``env`` (default :func:`cli_env`), its output
    captured as text: through this thread's fork server (see the module docstring), else as a
    fresh process."""
    return _run([str(a) for a in args], cwd, env, timeout, python=False)


def run_python(*argv: str | Path, cwd: Path, env: dict[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` (a plain script: a reference run, a documented example) in
    ``cwd``, through this thread's fork server, else as a fresh process."""
    return _run([str(a) for a in argv], cwd, env, timeout, python=True)


def _run(args: list[str], cwd: Path, env: dict[str, str] | None, timeout: float, *,
         python: bool) -> subprocess.CompletedProcess:
    env = env if env is not None else cli_env()
    if FORK:
        try:
            return _server().run(args, cwd, env, timeout, python=python)
        except subprocess.TimeoutExpired:
            raise
        except (RuntimeError, OSError, ValueError):  # the server is gone: a fresh process
            _servers.server = None
    cmd = [sys.executable, *args] if python else [*MODULE, *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)


def close_fork_servers() -> None:
    with _servers_lock:
        for server in _all_servers:
            server.close()
        _all_servers.clear()




def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interruptible(cmd: Sequence[str | Path], *, limit: float = 300, **popen: object,
                  ) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen)`` for a test that sends the child SIGINT: the child starts
    with SIGINT at its default whatever this process inherited (a shell's background job runs
    with SIGINT ignored, and Python then leaves it ignored, so a Ctrl-C would do nothing), in a
    process group of its own that is killed whole after ``limit`` seconds, so that a Ctrl-C that
    was lost fails the test instead of hanging the suite."""
    proc = subprocess.Popen([str(c) for c in cmd], preexec_fn=_default_sigint,
                            start_new_session=True, **popen)  # type: ignore[call-overload]

    def _kill() -> None:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(limit, _kill)
    timer.daemon = True
    timer.start()
    return proc
