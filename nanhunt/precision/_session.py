"""The audit's live session: which steps are traced, and the hooks that trace them.

Warm-up steps run untouched. When tracing begins, the observer's global module hooks and a
``TorchFunctionMode`` (which puts top-level calls on the tape) are installed; at each
``Tensor.backward`` on a tensor the model produced, the step is measured *before* the user's
backward runs (which then runs exactly as it would have). After ``steps`` audited steps the
hooks and the mode are removed and the rest of the run is plain again.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as _O
from torch.overrides import TorchFunctionMode

from nanhunt._patching import patch
from nanhunt.analyse import rank
from nanhunt.errors import NanhuntError
from nanhunt.precision._audit import Auditor
from nanhunt.precision._tape import call_entry, rng_state
from nanhunt.trace import PrecisionAudit, Recommendation

__all__ = ["AuditSession"]

_ACTIVE: AuditSession | None = None

# calls that never belong on the tape: the backward itself, and hook registration
_SKIP = {"backward", "register_hook", "register_post_accumulate_grad_hook", "__get__"}


class _TopLevel(TorchFunctionMode):
    """Puts top-level calls that touch the model's outputs on the tape."""

    def __init__(self, session: AuditSession) -> None:
        super().__init__()
        self.session = session

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        s = self.session
        obs = s.auditor.observer
        try:
            record = (obs.phase == "record" and obs.depth == 0 and not s.busy
                      and not s.paused and getattr(func, "__name__", "") not in _SKIP
                      and s.auditor.tape.tracks((args, kwargs)))
            rng = rng_state() if record else None
        except Exception as exc:  # never the user's problem
            s.fail(exc)
            record = False
        out = func(*args, **kwargs)
        if record:
            try:
                s.auditor.tape.add(call_entry(func, args, kwargs, out, module=False, rng=rng))
            except Exception as exc:
                s.fail(exc)
        return out


class AuditSession:
    """Trace ``steps`` steps after ``warmup`` and measure them (one session at a time)."""

    def __init__(self, targets: list[str] | None = None, *, steps: int = 3, warmup: int = 1,
                 label: str | None = None, quiet: Any = None) -> None:
        self.auditor = Auditor(targets)
        self.steps, self.warmup, self.label = steps, warmup, label
        # a context manager factory: other sessions (a callback's Hunt) stay out of the replays
        self.quiet = quiet or contextlib.nullcontext
        self.busy = False
        # between a framework's training steps (validation, logging): nothing is recorded and
        # a backward() is neither counted nor audited
        self.paused = False
        self.tracing = False
        self.done = False
        self.audit: PrecisionAudit | None = None
        self.recommendations: list[Recommendation] = []
        self._backwards = 0
        self._failed = False
        self._times: list[float | None] = []  # start of each backward; None marks a traced one
        self._stack: contextlib.ExitStack | None = None
        self._trace_stack: contextlib.ExitStack | None = None
        self._mode: _TopLevel | None = None

    # -- install --------------------------------------------------------------------------

    def start(self) -> AuditSession:
        global _ACTIVE
        if _ACTIVE is not None:
            raise NanhuntError("another nanhunt audit is already running in this process")
        with contextlib.ExitStack() as stack:
            self._patch(stack, torch.Tensor, "backward", self._wrap_backward)
            self._patch(stack, torch.amp.GradScaler, "scale", self._wrap_scale)
            stack.enter_context(_O.register_optimizer_step_post_hook(self._on_step))
            if self.warmup == 0:
                self._begin()
            self._stack = stack.pop_all()
        _ACTIVE = self
        return self

    def stop(self) -> None:
        """Remove every hook; a run that ended before ``steps`` audited steps is ranked on
        the steps it had (the report says how many)."""
        global _ACTIVE
        if not self.done and not self._failed and self.auditor.steps > 0:
            try:
                with self.quiet():
                    self._finish()
            except Exception as exc:  # never the user's problem
                self.fail(exc)
        self._end()
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        if _ACTIVE is self:
            _ACTIVE = None

    def __enter__(self) -> AuditSession:
        return self.start()

    def __exit__(self, *exc: object) -> bool:
        self.stop()
        return False

    _patch = staticmethod(patch)

    def _begin(self) -> None:
        if self.tracing or self.done:
            return
        obs = self.auditor.observer
        obs.on_root = self._on_root
        with contextlib.ExitStack() as stack:
            obs.install()
            stack.callback(obs.remove)
            self._mode = _TopLevel(self)
            self._mode.__enter__()
            stack.callback(self._pop_mode)
            self._trace_stack = stack.pop_all()
        obs.begin("record")
        self.tracing = True

    def _pop_mode(self) -> None:
        n = torch._C._len_torch_function_stack()
        if self._mode is not None and n and torch._C._get_function_stack_at(n - 1) is self._mode:
            self._mode.__exit__(None, None, None)
        self._mode = None

    def _end(self) -> None:
        if self._trace_stack is not None:
            self._trace_stack.close()
            self._trace_stack = None
        self.auditor.observer.end()
        self.auditor.observer.depth = 0
        self.tracing = False

    # -- callbacks ------------------------------------------------------------------------

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def _on_root(self, module: nn.Module, args: tuple, kwargs: dict, out: Any,
                 rng: Any, state: Any = None) -> None:
        if self.busy or self.paused:
            return
        try:
            self.auditor.name_root(module, self.label or _variable_name(module)
                                   or type(module).__name__)
            self.auditor.tape.add(call_entry(module, args, kwargs, out, module=True, rng=rng,
                                             state=state))
        except Exception as exc:  # a bug in the audit must never stop the user's training
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Stop auditing with a note; the run goes on untouched."""
        if self._failed:
            return
        self._failed = True
        self.auditor.notes.append(f"the audit stopped at step {self.auditor.steps}: "
                                  f"{type(exc).__name__}: {exc}")
        self.done = True
        # hooks and the mode come out at the next backward or at stop(): this may run inside
        # the mode's own handler, where the mode is not on top of the stack
        self.auditor.observer.end()
        self.auditor.tape.clear()
        self.auditor.kept.clear()

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.auditor.tape.clear()
        self.auditor._scaled.clear()

    def _wrap_scale(self, original: Any) -> Any:
        session = self

        def scale(scaler: Any, outputs: Any) -> Any:
            out = original(scaler, outputs)
            if session.tracing and isinstance(out, torch.Tensor) and isinstance(
                    outputs, torch.Tensor):
                session.auditor.note_scaled(out, outputs)
            return out

        return scale

    def _wrap_backward(self, original: Any) -> Any:
        session = self

        def backward(tensor: torch.Tensor, gradient: Any = None, *args: Any, **kwargs: Any):
            if session.busy:  # torch-function dispatch calls us again: run the original
                return original(tensor, gradient, *args, **kwargs)
            session.busy = True
            try:
                session._before_backward(tensor, gradient)
            finally:
                session.busy = False
            session.busy = True  # the re-entry from __torch_function__ goes straight through
            try:
                result = original(tensor, gradient, *args, **kwargs)
            finally:
                session.busy = False
            if session.paused:
                pass
            elif not session.tracing and not session.done and \
                    session._backwards >= session.warmup:
                session._begin()
            elif session.done and session.tracing:
                session._end()
            return result

        return backward

    def _before_backward(self, tensor: torch.Tensor, gradient: Any) -> None:
        if self.paused:
            return
        self._backwards += 1
        if not self.tracing:
            self._times.append(time.perf_counter())
            return
        self._times.append(None)
        self.measure(tensor, gradient if isinstance(gradient, torch.Tensor) else None)

    def measure(self, tensor: torch.Tensor, gradient: torch.Tensor | None = None) -> None:
        """Audit the step ending in ``tensor`` (the loss); finishes after ``steps`` steps."""
        obs = self.auditor.observer
        was, self.busy = self.busy, True
        try:
            with self.quiet():  # the advice check at the end replays too
                ok = self.auditor.measure(tensor, gradient)
                if ok and self.auditor.steps >= self.steps:
                    self._finish()
        except Exception as exc:  # a bug in the audit must never stop the user's training
            self.fail(exc)
        finally:
            self.busy = was
            if self.tracing and not self.done:
                obs.begin("record")

    def _finish(self, *, failed: bool = False) -> None:
        self.done = True
        try:
            if not failed:  # while the hooks are in and the last step's weights unchanged
                self.audit = self.auditor.result()
                if self.audit is not None:
                    self._advise()
        finally:
            self._end()
        self.auditor.tape.clear()
        self.auditor.kept.clear()

    def _advise(self) -> None:
        assert self.audit is not None
        for audit, state in zip([self.audit, *self.audit.compare], self.auditor.states,
                                strict=False):
            half = _half_model(state.plan)
            rec = rank.recommend(audit, lambda mods, st=state: self.auditor.fixed_loss_error(
                st, mods), half_model=half,
                device=(self.auditor.device or "cuda").split(":")[0])
            if rec is not None:
                self.recommendations.append(rec)

    def plain_step_seconds(self) -> float | None:
        """Median time between consecutive backward calls that were not audited."""
        gaps = [b - a for a, b in zip(self._times, self._times[1:], strict=False)
                if a is not None and b is not None]
        return statistics.median(gaps) if gaps else None


def _half_model(plan: Any) -> str | None:
    if plan is None or plan.cast_to is None:
        return None
    return str(plan.cast_to).removeprefix("torch.")


def _variable_name(obj: object) -> str | None:
    """The name the user's script gives ``obj`` in its globals (``model``, ``net``)."""
    main = sys.modules.get("__main__")
    for k, v in vars(main).items() if main else ():
        if v is obj and not k.startswith("_"):
            return k
    return None
