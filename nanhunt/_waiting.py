"""``wait(timeout)`` for the stand-ins of ``subprocess.Popen`` that nanhunt drives itself (a fork
server's zygote, a re-run forked by one): poll until an exit status, as Popen does."""

from __future__ import annotations

import subprocess
import time

__all__ = ["PollWait"]


class PollWait:
    """Mixin: ``wait`` over the subclass's ``poll()``; ``what`` names it in a timeout."""

    what = "process"
    returncode: int | None = None

    def poll(self) -> int | None:  # pragma: no cover - every subclass has its own
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        end = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.what, timeout or 0)
            time.sleep(0.01)
        return int(self.returncode or 0)
