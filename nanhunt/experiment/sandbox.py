"""Keep a verification re-run from overwriting what the user's own run wrote.

In a re-run (``NANHUNT_RERUN=1``, a scratch folder in ``NANHUNT_SCRATCH``), :func:`install`
sends ``torch.save`` to a path, and the log and output folders of TensorBoard's
``SummaryWriter``, Lightning's ``Trainer`` and Hugging Face's ``TrainingArguments``, into the
scratch folder; ``torch.load`` of a path the re-run saved reads the redirected copy. Each
redirection is listed in ``redirected.txt`` there (the report lists them). The parent also sets
``WANDB_MODE=disabled``. Anything else the script writes with ``open()`` is not redirected:
scripts can test ``NANHUNT_RERUN`` to skip their own side effects.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from typing import Any

import torch

from nanhunt._patching import patch

__all__ = ["Sandbox", "install"]

# module -> (class, the arguments naming where it writes). Only the arguments the installed
# version has count (transformers 5 has no logging_dir); the first of them is redirected also
# when the script leaves it to its default (a folder in the working directory), the others only
# when given (left out, they follow the first).
_WRITERS = {
    "torch.utils.tensorboard.writer": ("SummaryWriter", ("log_dir",)),
    "tensorboardX.writer": ("SummaryWriter", ("logdir", "log_dir")),
    "lightning.pytorch.trainer.trainer": ("Trainer", ("default_root_dir",)),
    "pytorch_lightning.trainer.trainer": ("Trainer", ("default_root_dir",)),
    "transformers.training_args": ("TrainingArguments", ("output_dir", "logging_dir")),
}


class Sandbox:
    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.map: dict[str, str] = {}
        self._stack = contextlib.ExitStack()

    def redirect(self, path: Any, what: str) -> str:
        original = os.path.abspath(os.fspath(path))
        if original.startswith(str(self.scratch)):
            return original
        if original not in self.map:
            target = self.scratch / original.lstrip(os.sep)
            target.parent.mkdir(parents=True, exist_ok=True)
            self.map[original] = str(target)
            with open(self.scratch / "redirected.txt", "a", encoding="utf-8") as f:
                f.write(f"{what}: {os.fspath(path)} -> {RERUN_NOTE}\n")
        return self.map[original]

    def install(self) -> Sandbox:
        self.scratch.mkdir(parents=True, exist_ok=True)
        self._patch(torch, "save", self._wrap_save)
        self._patch(torch, "load", self._wrap_load)
        for name in _WRITERS:
            if name in sys.modules:
                self._patch_writer(sys.modules[name])
        finder = _AfterImport(self)
        sys.meta_path.insert(0, finder)
        self._stack.callback(sys.meta_path.remove, finder)
        return self

    def uninstall(self) -> None:
        self._stack.close()

    def _patch(self, owner: Any, name: str, wrapper: Any) -> None:
        patch(self._stack, owner, name, wrapper)

    def _wrap_save(self, original: Any) -> Any:
        def to_scratch(f: Any) -> Any:
            return self.redirect(f, "torch.save") if isinstance(f, (str, os.PathLike)) else f

        return _rebinding(original, {"f": to_scratch})

    def _wrap_load(self, original: Any) -> Any:
        def from_scratch(f: Any) -> Any:
            if isinstance(f, (str, os.PathLike)):
                return self.map.get(os.path.abspath(os.fspath(f)), f)
            return f

        return _rebinding(original, {"f": from_scratch})

    def _patch_writer(self, module: Any) -> None:
        cls_name, args = _WRITERS[module.__name__]
        cls = getattr(module, cls_name, None)
        if cls is None or "__init__" not in cls.__dict__:
            return
        sandbox = self

        def wrap(original: Any) -> Any:
            present = [a for a in args if a in _parameters(original)]

            def redirect(arg: str, first: bool) -> Any:
                def to_scratch(where: Any) -> Any:
                    if where is None and not first:
                        return None
                    return sandbox.redirect(where or f"{cls_name.lower()}-default",
                                            f"{cls_name}({arg})")

                return to_scratch

            return _rebinding(original, {a: redirect(a, i == 0) for i, a in enumerate(present)},
                              defaults=present[:1])

        self._patch(cls, "__init__", wrap)


def _parameters(fn: Any) -> Any:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def _rebinding(original: Any, change: dict[str, Any], defaults: list[str] | None = None) -> Any:
    """``original`` with the arguments named in ``change`` passed through it, wherever the
    caller put them (by position or keyword); ``defaults`` are changed also when the caller
    left them out. A call that does not bind raises as ``original`` itself would."""
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        return original

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        for name, fn in change.items():
            if name in bound.arguments:
                bound.arguments[name] = fn(bound.arguments[name])
            elif defaults and name in defaults:
                value = fn(signature.parameters[name].default)
                if value is not None:
                    bound.arguments[name] = value
        return original(*bound.args, **bound.kwargs)

    call.__wrapped__ = original  # type: ignore[attr-defined]
    call.__name__ = getattr(original, "__name__", "call")
    call.__doc__ = getattr(original, "__doc__", None)
    return call


RERUN_NOTE = "the re-run's scratch folder"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patch a writer class when its module is first imported by the script."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _WRITERS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader, sandbox = spec.loader, self.sandbox
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            sandbox._patch_writer(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install() -> Sandbox | None:
    """In a verification re-run, redirect the script's checkpoint and log writers."""
    scratch = os.environ.get("NANHUNT_SCRATCH")
    if os.environ.get("NANHUNT_RERUN") != "1" or not scratch:
        return None
    return Sandbox(Path(scratch)).install()
