"""Run the real CLI in a subprocess, as a user would: `nanhunt ...` and `python -m nanhunt ...`.

Every CLI run pays a Python start and a torch import (about 3 s of CPU before the script's first
step), so the suite shares them:

* ``cli`` (session-scoped, :class:`CliRuns`): one run per distinct command line for the whole
  session, whichever test or file asks for it, each in a fresh folder; its result is shared
  read-only. Runs go through a small thread pool, so the runs of a module overlap each other
  and the tests that run in this process.
* prefetch: a test module may define ``prefetch(cli)``, which submits the runs its fixtures
  will read (and returns at once). It is called for every collected module when collection
  ends, in test order, so a module's runs are under way while earlier tests run; its fixtures
  then call the same function and wait for the results.
* ``run_cli`` (function-scoped): one run for one test, in that test's tmp_path.
* ``quiet_pool``: no pool run during a test that times a child in wall-clock seconds.

``python -m nanhunt ...`` runs go through nanhunt's fork server (:mod:`nanhunt.cli.forkserver`,
one per thread of this process): each run is a child forked from a process that imported torch
and nanhunt once, in its own process group, its own folder and environment, with ``sys.argv`` and
``sys.path[0]`` as ``python -m nanhunt`` sets them, so a run costs its script and no import.
``NANHUNT_TEST_FORK=0`` runs each as a fresh process instead; the tests of the launchers
themselves (the launchers, the console script, the pseudo-terminal, Ctrl-C) always do.

``nanhunt diagnose`` gets ``--verify 0`` (no re-run verification) unless ``verify=True``: the
re-runs cost up to four more runs of the script, and only the tests about verification need
them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from clirun import MODULE, cli_env, run_nanhunt, run_python

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SCRIPTS = ROOT / "tests" / "scripts"

#: CLI runs at once in the shared pool: two keep a two-core CI machine busy alongside this process
JOBS = int(os.environ.get("NANHUNT_TEST_JOBS", "2"))
#: a file to append each pool run's wall seconds and command to (unset: none)
TIMES = os.environ.get("NANHUNT_TEST_TIMES")


def _launchers() -> list[list[str]]:
    found = [[sys.executable, "-m", "nanhunt"]]
    exe = shutil.which("nanhunt")
    if exe:
        found.insert(0, [exe])
    return found


class Result:
    def __init__(self, proc: subprocess.CompletedProcess, out: Path, cwd: Path | None = None,
                 ) -> None:
        self.code = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.out = out
        self.cwd = cwd if cwd is not None else out.parent
        self._report: dict | None = None

    @property
    def returncode(self) -> int:  # as subprocess.CompletedProcess calls it
        return self.code

    @property
    def report(self) -> dict:
        # parsed once: a shared run's report is read by many tests (treat it as read-only)
        if self._report is None:
            self._report = json.loads((self.out / "report.json").read_text())
        return self._report

    @property
    def text(self) -> str:
        return (self.out / "report.txt").read_text()

    @property
    def html(self) -> str:
        return (self.out / "report.html").read_text()


def _with_verify(args: Sequence[str], verify: bool) -> tuple[str, ...]:
    args = tuple(str(a) for a in args)
    if args[:1] == ("diagnose",) and not verify:
        # re-run verification costs re-runs of the script: only for the tests about it
        return ("diagnose", "--verify", "0", *args[1:])
    return args


class CliRuns:
    """One run per distinct command, shared by the whole session (see the module docstring)."""

    launchers = staticmethod(_launchers)  # the console script (where installed), python -m nanhunt
    env = staticmethod(cli_env)

    def __init__(self, base: Path, jobs: int = JOBS) -> None:
        self.base = base
        self._pool = ThreadPoolExecutor(max(1, jobs), thread_name_prefix="cli")
        self._done: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._count = 0
        self._gate = threading.Condition()  # see quiet()
        self._paused = 0
        self._running = 0

    def _folder(self) -> Path:
        with self._lock:
            self._count += 1
            n = self._count
        path = self.base / f"run-{n:03d}"
        path.mkdir()
        return path

    def _task(self, fn: Callable[[Path], object], key: tuple) -> object:
        with self._gate:
            while self._paused:
                self._gate.wait()
            self._running += 1
        start = time.monotonic()
        try:
            return fn(self._folder())
        finally:
            with self._gate:
                self._running -= 1
                self._gate.notify_all()
            if TIMES:  # where the pool's time goes: its runs are in no test's --durations
                with open(TIMES, "a") as f:
                    f.write(f"{time.monotonic() - start:.2f}\t{' '.join(map(str, key))}\n")

    def call(self, key: tuple, fn: Callable[[Path], object]) -> Future:
        """``fn(fresh folder)`` once per ``key`` in the pool; the future of its result."""
        with self._lock:
            fut = self._done.get(key)
            if fut is None:
                fut = self._done[key] = self._pool.submit(self._task, fn, key)
        return fut

    @contextlib.contextmanager
    def quiet(self):
        """No pool run during the block: for a test that times a child in wall-clock seconds
        (the machine as busy as without the pool). Waits for the runs under way to end."""
        with self._gate:
            self._paused += 1
            while self._running:
                self._gate.wait()
        try:
            yield
        finally:
            with self._gate:
                self._paused -= 1
                self._gate.notify_all()

    def submit(self, *args: str | Path, verify: bool = False, cmd: Sequence[str] | None = None,
               timeout: float = 600, env: dict[str, str] | None = None) -> Future:
        """``nanhunt ARGS`` (``python -m nanhunt`` unless ``cmd``) in a fresh folder, which is
        its working directory; its reports are in ``<folder>/nanhunt-report``."""
        full = (*(cmd or MODULE), *_with_verify(args, verify))
        extra = tuple(sorted((env or {}).items()))
        forked = cmd is None  # a launcher named by the test runs as itself

        def run(cwd: Path) -> Result:
            if forked:
                proc = run_nanhunt(full[len(MODULE):], cwd, env=cli_env(**dict(extra)),
                                   timeout=timeout)
            else:
                proc = subprocess.run(full, cwd=cwd, capture_output=True, text=True,
                                      timeout=timeout, env=cli_env(**dict(extra)))
            return Result(proc, cwd / "nanhunt-report", cwd)

        return self.call(("cli", full, extra, forked), run)

    def submit_with_files(self, files: dict[str, str], *args: str | Path, verify: bool = False,
                          cmd: Sequence[str] | None = None, timeout: float = 600) -> Future:
        """As :meth:`submit`, with ``files`` (relative path -> text) written into the run's
        folder first; ``{cwd}`` in an argument is that folder."""
        launcher = tuple(cmd or MODULE)
        args = _with_verify(args, verify)

        def run(cwd: Path) -> Result:
            for name, text in files.items():
                (cwd / name).parent.mkdir(parents=True, exist_ok=True)
                (cwd / name).write_text(text)
            argv = [a.format(cwd=cwd) if "{cwd}" in a else a for a in args]
            if cmd is None:
                proc = run_nanhunt(argv, cwd, timeout=timeout)
            else:
                proc = subprocess.run([*launcher, *argv], cwd=cwd, capture_output=True,
                                      text=True, timeout=timeout, env=cli_env())
            return Result(proc, cwd / "nanhunt-report", cwd)

        return self.call(("files", tuple(sorted(files.items())), launcher, args, cmd is None),
                         run)

    def get(self, *args: str | Path, **kw) -> Result:
        return self.submit(*args, **kw).result()

    def python(self, *argv: str | Path, timeout: float = 600) -> Future:
        """``python ARGV`` (a plain script or a reference) in a fresh folder, once."""
        full = (sys.executable, *(str(a) for a in argv))

        def run(cwd: Path) -> subprocess.CompletedProcess:
            # through this thread's fork server, as python runs it (no torch import per run)
            return run_python(*full[1:], cwd=cwd, timeout=timeout)

        return self.call(("python", full), run)

    def python_with_files(self, files: dict[str, str], *argv: str | Path,
                          timeout: float = 600) -> Future:
        """``python ARGV`` (through this thread's fork server, as :meth:`python`) in a fresh
        folder with ``files`` written into it first, once; ``{cwd}`` in an argument is that
        folder. The result is a :class:`Result` (its ``cwd`` the folder)."""
        def run(cwd: Path) -> Result:
            for name, text in files.items():
                (cwd / name).parent.mkdir(parents=True, exist_ok=True)
                (cwd / name).write_text(text)
            args = [a.format(cwd=cwd) if "{cwd}" in a else a for a in map(str, argv)]
            proc = run_python(*args, cwd=cwd, timeout=timeout)
            return Result(proc, cwd / "nanhunt-report", cwd)

        return self.call(("python-files", tuple(sorted(files.items())), tuple(map(str, argv))),
                         run)

    def close(self) -> None:
        for fut in self._done.values():
            fut.cancel()
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.base, ignore_errors=True)


_CLI: CliRuns | None = None


def _session_cli() -> CliRuns:
    global _CLI
    if _CLI is None:
        _CLI = CliRuns(Path(tempfile.mkdtemp(prefix="nanhunt-cli-")))
    return _CLI


@pytest.fixture(scope="session")
def cli() -> CliRuns:
    return _session_cli()


def pytest_collection_finish(session):
    # start every selected module's shared runs now, in test order (see the module docstring)
    seen = set()
    for item in session.items:
        module = getattr(item, "module", None)
        if module is None or module in seen:
            continue
        seen.add(module)
        prefetch = getattr(module, "prefetch", None)
        if callable(prefetch) and not session.config.option.collectonly:
            prefetch(_session_cli())


def pytest_sessionfinish(session):
    global _CLI
    if _CLI is not None:
        _CLI.close()
        _CLI = None


@pytest.fixture
def quiet_pool(cli):
    """Holds the shared pool's runs for the test (see CliRuns.quiet)."""
    with cli.quiet():
        yield


@pytest.fixture
def run_cli(tmp_path):
    def run(*args: str, cmd: list[str] | None = None, cwd: Path | None = None,
            timeout: float = 180, verify: bool = False) -> Result:
        if cmd is None:  # a launcher named by the test runs as itself
            proc = run_nanhunt(_with_verify(args, verify), cwd or tmp_path, timeout=timeout)
        else:
            proc = subprocess.run([*cmd, *_with_verify(args, verify)], cwd=cwd or tmp_path,
                                  capture_output=True, text=True, timeout=timeout,
                                  env=cli_env())
        return Result(proc, (cwd or tmp_path) / "nanhunt-report", cwd or tmp_path)

    return run
