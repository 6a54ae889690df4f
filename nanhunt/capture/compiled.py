"""Compiled modules (``torch.compile(module)``) seen from outside.

nanhunt's global module hooks would be traced into a compiled module's graph: Dynamo inlines or
breaks on them, inductor then fuses differently, the losses change from the first step, and
torch warns into the user's stderr that global hooks fire for the ``OptimizedModule``. So while
a compiled module runs, nanhunt's own observing hooks are taken out of torch's global hook
tables (the user's and a ``--fix``'s stay) and the call is recorded at its boundary, as one
module call: its inputs, its outputs and their gradients. The graph Dynamo builds is then the
one the plain run builds, and nothing recompiles. The modules inside are not observed; the
report says which compiled modules were seen only at their boundary.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from torch.nn.modules import module as _M

__all__ = ["OBSERVERS", "compiled_boundary", "compiled_run_eagerly", "global_forward_hook",
           "observing_hooks_removed"]

#: nanhunt's packages whose global module hooks only observe (a --fix's hooks change the
#: program on purpose and stay)
OBSERVERS = ("nanhunt.capture", "nanhunt.precision")
_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
           "_global_backward_hooks")


def _ours(fn: Any) -> bool:
    return str(getattr(fn, "__module__", "") or "").startswith(OBSERVERS)


@contextlib.contextmanager
def observing_hooks_removed() -> Iterator[None]:
    """nanhunt's observing global module hooks out of torch's tables, then back in place (a hook
    registered meanwhile keeps its place after them)."""
    saved: list[tuple[dict, list[tuple[Any, Any]], dict]] = []
    for name in _TABLES:
        table = getattr(_M, name, None)
        if not isinstance(table, dict) or not any(_ours(fn) for fn in table.values()):
            continue
        before = list(table.items())
        flags = {}
        for key, fn in before:
            if _ours(fn):
                del table[key]
                for flag_table in ("_global_forward_hooks_with_kwargs",
                                   "_global_forward_hooks_always_called"):
                    flags_dict = getattr(_M, flag_table, None)
                    if isinstance(flags_dict, dict) and key in flags_dict:
                        flags[(flag_table, key)] = flags_dict.pop(key)
        saved.append((table, before, flags))
    try:
        yield
    finally:
        for table, before, flags in saved:
            added = [(k, v) for k, v in table.items() if all(k != b for b, _ in before)]
            table.clear()
            table.update(before)
            table.update(added)
            for (flag_table, key), value in flags.items():
                getattr(_M, flag_table)[key] = value


def global_forward_hook(hook: Any) -> Any:
    """``register_module_forward_hook(hook, with_kwargs=True)``, whose handle, once removed, also
    takes its with_kwargs flag out: torch's handle leaves it in
    ``_global_forward_hooks_with_kwargs``, and that flag alone makes every later compiled
    module call warn into the user's stderr that global hooks exist."""
    handle = _M.register_module_forward_hook(hook, with_kwargs=True)
    flags = getattr(_M, "_global_forward_hooks_with_kwargs", None)
    if isinstance(flags, dict):
        extra = getattr(handle, "extra_dict_ref", ())
        handle.extra_dict_ref = (*extra, weakref.ref(flags))
    return handle


def _optimized_module() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # a torch without Dynamo
        return None
    return OptimizedModule


@contextlib.contextmanager
def _call_replaced(cls: type, make: Any) -> Iterator[None]:
    """``cls.__call__`` replaced by ``make(original)`` while entered, then put back as it was
    (a class attribute of its own, or inherited)."""
    own = "__call__" in cls.__dict__
    original = cls.__call__
    cls.__call__ = make(original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own:
            cls.__call__ = original  # type: ignore[method-assign]
        else:
            del cls.__call__


@contextlib.contextmanager
def compiled_boundary(pre: Any, post: Any, seen: set[str], naming: Any) -> Iterator[None]:
    """While installed, a call of a compiled module runs with nanhunt's observing hooks out of
    the tables; ``pre(module, args)`` and ``post(module, args, kwargs, output)`` record it from
    outside. ``seen`` collects the names of the compiled modules that ran."""
    cls = _optimized_module()
    if cls is None:
        yield
        return

    def make(original: Any) -> Any:
        def __call__(module: Any, *args: Any, **kwargs: Any) -> Any:
            pre(module, args)
            with observing_hooks_removed():
                output = original(module, *args, **kwargs)
            post(module, args, kwargs, output)
            with contextlib.suppress(Exception):
                seen.add(naming.names.get(module) or naming.names.get(module._orig_mod)
                         or type(module._orig_mod).__name__)
            return output

        __call__.__wrapped__ = original  # type: ignore[attr-defined]
        return __call__

    with _call_replaced(cls, make):
        yield


@contextlib.contextmanager
def compiled_run_eagerly() -> Iterator[None]:
    """While entered, a compiled module runs its original module eagerly, as a plain module
    call with every hook (nanhunt's replays of a recorded step: a re-compile would print
    Dynamo's logs and torch's global-hooks warning into the user's stderr, and a replay is the
    reference arithmetic, not the compiled run's)."""
    cls = _optimized_module()
    if cls is None:
        yield
        return
    import torch

    with _call_replaced(cls, lambda original: _M.Module.__call__), \
            torch.compiler.set_stance("force_eager"):
        yield
