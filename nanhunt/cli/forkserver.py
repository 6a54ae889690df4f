"""A process that imports torch and nanhunt once, then forks a fresh child for each re-run.

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
from pathlib import Path

__all__ = ["serve"]


def _child(request: dict) -> int:
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
    from nanhunt.cli.main import main

    try:
        if request.get("python"):
            import runpy

            runpy.run_path(script, run_name="__main__")
            return 0
        return main(request["argv"])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 3
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def serve() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # what every re-run would import again; the first optimizer imports torch._dynamo
    for name in ("torch", "torch._dynamo", "nanhunt.cli.main", "nanhunt.experiment.fixes",
                 "nanhunt.pipeline",
                 "nanhunt.experiment.sandbox"):
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        out.flush()
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                code = _child(request)
            finally:
                os._exit(code if isinstance(code, int) else 1)
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
