"""Snapshot files: the culprit (class and state), its inputs and output gradients written to
``snapshot.pt`` beside the report, and read back for ``nanhunt replay``."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
import types
from pathlib import Path

import torch

from nanhunt.capture.state import Snapshot
from nanhunt.errors import NanhuntError

__all__ = ["load_snapshot", "save_snapshot"]

_SNAPSHOT_FORMAT = "nanhunt-snapshot"
_SNAPSHOT_VERSION = 1


@contextlib.contextmanager
def _main_module_from(globals_: dict | None):
    """Make ``__main__`` resolve to the user's script globals while pickling/unpickling."""
    if globals_ is None:
        yield
        return
    saved = sys.modules.get("__main__")
    fake = types.ModuleType("__main__")
    fake.__dict__.update(globals_)
    sys.modules["__main__"] = fake
    try:
        yield
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _script_globals(module: torch.nn.Module) -> dict | None:
    for m in module.modules():
        if type(m).__module__ == "__main__":
            fwd = type(m).__dict__.get("forward") or type(m).__dict__.get("__init__")
            if fwd is not None and hasattr(fwd, "__globals__"):
                return fwd.__globals__
    return None


def save_snapshot(snap: Snapshot, path: Path, *, script: str = "") -> str:
    """Write the culprit (class and state), its inputs and grad_outputs to ``path``."""
    from nanhunt.report.files import atomic_write_bytes

    buf = io.BytesIO()
    with _main_module_from(_script_globals(snap.module)):
        torch.save(snap.module, buf)
    payload = {
        "format": _SNAPSHOT_FORMAT,
        "version": _SNAPSHOT_VERSION,
        "name": snap.name,
        "phase": snap.phase,
        "step": snap.step,
        "class": f"{type(snap.module).__module__}.{type(snap.module).__qualname__}",
        "script": str(Path(script).resolve()) if script else "",
        "autocast": [snap.autocast[0], str(snap.autocast[1]).removeprefix("torch.")
                     if snap.autocast[1] is not None else None],
        "module_bytes": buf.getvalue(),
        "args": snap.args,
        "kwargs": snap.kwargs,
        "grad_outputs": snap.grad_outputs,
        "stale_inputs": snap.stale_inputs,
        "call_site": list(snap.call_site) if snap.call_site else None,
    }
    out = io.BytesIO()
    torch.save(payload, out)
    atomic_write_bytes(Path(path), out.getvalue())
    return str(path)


def load_snapshot(path: str | Path, *, script: str | None = None) -> Snapshot:
    """Load a snapshot written by :func:`save_snapshot`; classes from the training script
    need the script (``script=``, or the recorded path when it guards its training with
    ``if __name__ == "__main__":``)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise NanhuntError(f"no such snapshot: {path}") from None
    except Exception as exc:
        raise NanhuntError(f"{path} is not a nanhunt snapshot ({type(exc).__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != _SNAPSHOT_FORMAT:
        raise NanhuntError(f"{path} is not a nanhunt snapshot")
    if payload.get("version") != _SNAPSHOT_VERSION:
        raise NanhuntError(f"snapshot version {payload.get('version')} is not supported")
    cls = payload["class"]
    globals_ = None
    if cls.startswith("__main__."):
        script = script or payload.get("script") or None
        if script is None or not Path(script).exists():
            raise NanhuntError(
                f"the culprit's class {cls[9:]} is defined in the training script; "
                "pass it with --script train.py")
        if script != payload.get("script") or _guarded(Path(script)):
            globals_ = runpy.run_path(str(script), run_name="__nanhunt_replay__")
        else:
            raise NanhuntError(
                f"the culprit's class {cls[9:]} is defined in {script}, which has no "
                "'if __name__ == \"__main__\":' guard; pass --script explicitly to import it "
                "(its top-level code will run)")
    try:
        with _main_module_from(globals_):
            module = torch.load(io.BytesIO(payload["module_bytes"]), map_location="cpu",
                                weights_only=False)
    except (AttributeError, ModuleNotFoundError, ImportError) as exc:
        raise NanhuntError(f"cannot import the culprit's class {cls}: {exc}") from None
    enabled, dtype = payload["autocast"]
    return Snapshot(module=module, name=payload["name"], args=payload["args"],
                    kwargs=payload["kwargs"], grad_outputs=payload["grad_outputs"],
                    autocast=(bool(enabled), getattr(torch, dtype) if dtype else None),
                    phase=payload["phase"], step=payload["step"],
                    stale_inputs=list(payload.get("stale_inputs") or []),
                    call_site=tuple(payload["call_site"]) if payload.get("call_site") else None)


def _guarded(path: Path) -> bool:
    text = path.read_text(encoding="utf-8", errors="replace")
    return "__name__" in text and "__main__" in text
