"""The session: :class:`Hunt` composes the observers, the recorder and the judge, owns every
handle through one ExitStack, and decides where a step ends.

Data flows one way: the observers (:mod:`.modules`, :mod:`.autograd`, :mod:`.loss`,
:mod:`.optimizer`, :mod:`.scaler`) summarise tensors on their own device (:mod:`nanhunt.stats`)
and queue the rows in the :class:`~.recorder.Recorder`; once per step the queued rows cross to
the host in one transfer; the host side turns them into records, per-module ranges and step
records, and the :class:`~.judge.Judge` asks :mod:`nanhunt.capture.locate` for the origin when a
step
has a problem.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import sys
import threading
import traceback
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanhunt.capture._util import _autocast_state, user_frame
from nanhunt.capture.autograd import AutogradObserver
from nanhunt.capture.comm import CommObserver
from nanhunt.capture.judge import Judge
from nanhunt.capture.loss import LossObserver
from nanhunt.capture.modules import ModuleObserver
from nanhunt.capture.naming import Naming
from nanhunt.capture.optimizer import OptimizerObserver
from nanhunt.capture.recorder import Recorder
from nanhunt.capture.scaler import ScalerObserver
from nanhunt.capture.signals import SignalObserver
from nanhunt.capture.snapshot import Snapshots
from nanhunt.capture.state import OptimizerSnapshot, Snapshot, StepState, _StepData
from nanhunt.errors import NanhuntError
from nanhunt.formats import NumberFormat, get_format
from nanhunt.trace import (
    Crash,
    Failure,
    LayerStats,
    LoopCall,
    OptimizerInfo,
    RunInfo,
    ScalerEvent,
    StepRecord,
    TensorRecord,
    Trace,
)

_LOW = {torch.float16: "float16", torch.bfloat16: "bfloat16"}

_LOCK = threading.Lock()
_ACTIVE: Any = None  # the one session installed in this process


class StopRun(BaseException):
    """Raised out of a training step to stop the script once the failing step is captured."""


class Session:
    """A capture session: the parts it composes (:meth:`_compose`), one ExitStack owning every
    hook and patch they install, the step in flight (:attr:`cur`) and where steps end.

    :class:`Hunt` (full tracing) and :class:`~nanhunt.capture.sentinel.Sentinel` (cheap checks,
    replay on a failure) are two compositions of the same observers, recorder and judge.
    """

    #: the session ``nanhunt diagnose`` runs the script under: a session the script starts
    #: itself (``nanhunt.sentinel``, ``nanhunt.watch``, a callback's) stands aside under it
    owns_process = False
    #: the CLI's session this one stood aside for (it installs nothing and records nothing;
    #: its ``first_failure`` is that session's); False when it did not
    aside: Any = False

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any = None,
        *,
        target: str | None = "auto",
        keep_steps: int = 64,
        allow_inf: Iterable[str] = (),
        sample_every: int = 1,
        keep_tensors: bool = True,
        stop_on_problem: bool = False,
        max_steps: int | None = None,
        collapse_scale: float = 1.0,
        on_step: Any = None,
        first_step: int = 0,
    ) -> None:
        if keep_steps < 1:
            raise NanhuntError("keep_steps must be at least 1")
        if sample_every < 1:
            raise NanhuntError("sample_every must be at least 1")
        # "auto": the low-precision format the run turns out to use (autocast's dtype, else
        # half/bfloat16 parameters), decided at the first module call that shows one
        self._target_auto = target is None or target == "auto"
        self.format: NumberFormat = get_format("float16" if self._target_auto else target)
        self.target = self.format.name
        self.target_source = "default" if self._target_auto else "option"
        self.first_step = first_step
        self.keep_steps = keep_steps
        self.allow_inf = tuple(allow_inf)
        self.sample_every = sample_every
        self.keep_tensors = keep_tensors
        self.stop_on_problem = stop_on_problem
        self.collapse_scale = collapse_scale
        self.max_steps = max_steps
        self.on_step = on_step  # called with each finished StepRecord (the CLI's live line)
        self._model_ref = weakref.ref(model) if model is not None else None
        self._optimizer_ref = weakref.ref(optimizer) if optimizer is not None else None
        self._scaler_ref = weakref.ref(scaler) if scaler is not None else None
        self._stack: contextlib.ExitStack | None = None
        self._reset()

    # -- composition and state ------------------------------------------------------------

    def _reset(self) -> None:
        self.judge = Judge(self.collapse_scale, on_failure=self._on_failure)
        self.naming = Naming()
        self.recorder = Recorder(self.format, self.keep_steps, self.naming.types, self.judge)
        self.judge.recorder = self.recorder
        # a step that ran a backward in a loop with no torch optimizer is followed by the
        # script's own update: its weights change as after an optimizer step
        self.judge.updates_itself = lambda: self.cur.did_backward and not (
            self._saw_optimizer or self._optimizer_exists or self.scaler_seen)
        self.loss = LossObserver(self)
        self.scaler_obs = ScalerObserver(self)
        self.optimizer_obs = OptimizerObserver(self)
        self.signals = SignalObserver(self)
        self.snapshots = Snapshots(self)
        self._compose()
        self.internal_errors: list[str] = []
        self.stood_aside: list[str] = []  # sessions the script started under this one's watch
        self.snapshot: Snapshot | None = None
        # the optimizer step that made a parameter non-finite, copied just before it ran
        self.optimizer_snapshot: OptimizerSnapshot | None = None
        self.optimizer_infos: dict[int, OptimizerInfo] = {}  # id(optimizer) -> what it was
        self.loop_calls: dict[str, LoopCall] = {}  # misuse code -> where the user's loop did it
        self.crash: Crash | None = None  # the script's exception, located (set by the CLI)
        self._in_scaler_step = 0  # inside GradScaler.step(): its optimizer.step() is its own
        self.failure_extra: dict[str, Any] = {}
        self.devices: set[str] = set()
        self.autocast_seen = False
        self.scaler_seen = False
        self.scaler_settings: dict[str, float] | None = None
        self._active = False
        # the thread that runs the training step: global hooks ignore module calls and
        # optimizer steps from other threads (a background evaluation, DataParallel replicas)
        self._thread = threading.get_ident()
        self._step = self.first_step  # a framework's step count (resumed runs start past 0)
        self._stop_pending = False
        self._saw_optimizer = False
        # a step before this one ran a backward: the run trains, so a no-grad forward is
        # evaluation between training steps, not an inference step (loops with no optimizer)
        self._trained = False
        self._optimizer_ran_step = -1
        self._unscaled_step = -1
        # the step scaler.update() ended, and the parameters whose gradients it scaled: an
        # optimizer.step() before the next backward applies those gradients again
        self._updated_step = -1
        self._updated_params: set[int] = set()
        self._closure_step = -1
        self._in_closure = 0  # depth of optimizer closures running (LBFGS, Lightning)
        self._optimizers_seen: set[int] = set()
        self._optimizer_exists = self._optimizer_ref is not None
        self._first_optimizer: weakref.ref | None = None  # the first one the script made
        self._begin_step_state()

    def _compose(self) -> None:
        """Make this session's own parts (beyond the loss, scaler and optimizer observers)."""

    def _observers(self) -> list[Any]:
        """The parts whose hooks :meth:`start` installs, in order."""
        # (the optimizer observer's pre-hook last: a sentinel's replay runs inside it and
        # installs hooks of its own, which no global hook may follow in that step's iteration)
        return [self.loss, self.scaler_obs, self.signals, self.optimizer_obs]

    def _begin_step_state(self) -> None:
        self.cur = StepState(self.keep_tensors)
        self.recorder.begin_step(self._step)
        self._full = self._step % self.sample_every == 0 or bool(self.judge.problem_steps)
        self.cur.traced = self._full
        if self._full:
            self.judge.traced_steps.add(self._step)
        self._step_begun()

    def _step_begun(self) -> None:
        """A new step is in flight (``cur`` and ``_full`` are set)."""

    # -- public API ---------------------------------------------------------------------

    @property
    def steps(self) -> list[StepRecord]:
        """One record per step seen (the most recent ``keep_steps`` thousand at most)."""
        return self.recorder.steps

    @property
    def layers(self) -> list[LayerStats]:
        """Per-module forward and backward ranges over the recorded steps, execution order."""
        layers = [self.recorder.layer_stats(acc) for acc in self.recorder.accs.values()]
        for layer in layers:
            layer.params = self.naming.params.get(layer.module, 0)
        return layers

    @property
    def step(self) -> int:
        """Index of the step now being recorded."""
        return self._step

    @property
    def first_failure(self) -> Failure | None:
        if self.aside is not False:  # the CLI's session's: what the script asks, it answers
            return self.aside.first_failure
        # a failure on a step sampled mode did not trace, until (unless) a traced step fails
        return self.judge.first_failure or self.judge.untraced_failure

    @property
    def problem(self) -> str | None:
        return self.judge.problem

    @property
    def facts(self) -> list[str]:
        return self.judge.facts

    @property
    def dtypes(self) -> set[str]:
        return self.recorder.dtypes

    @property
    def scaler_events(self) -> list[ScalerEvent]:
        return self.recorder.scaler_events

    def records(self, step: int | None = None) -> list[TensorRecord]:
        """Decoded tensor records of a step still in the ring buffer (default: the last)."""
        return self.recorder.records(step)

    def grad_histograms(self) -> dict[str, dict[int, int]]:
        """Unscaled gradient exponent histograms (binade -> count), by gradient dtype."""
        return self.recorder.grad_histograms()

    def start(self) -> Session:
        global _ACTIVE
        with _LOCK:
            if _ACTIVE is not None and _ACTIVE.owns_process and not self.owns_process:
                # the script's own session under nanhunt diagnose: the CLI's traces every step
                # already; this one installs nothing, and the script runs as under python
                self.aside = _ACTIVE
                _ACTIVE.stood_aside.append(type(self).__name__)
                return self
            if _ACTIVE is not None:
                raise NanhuntError("another nanhunt session is already active in this process")
            _ACTIVE = self
        self._thread = threading.get_ident()
        try:
            self._install()
        except BaseException:
            if self._stack is not None:  # roll a partial install back
                self._stack.close()
                self._stack = None
            with _LOCK:
                _ACTIVE = None
            raise
        return self

    def stop(self) -> None:
        """Flush the last step, detach every hook and restore everything patched."""
        global _ACTIVE
        if self._stack is None:
            return
        try:
            # a bug of ours in the last transfer must not lose what the run recorded: it is
            # an internal error in the report, and stop() goes on detaching everything
            with contextlib.suppress(StopRun):
                self._guard(self._final_flush)
            with contextlib.suppress(StopRun):
                self._guard(self._session_ending)
        finally:
            self._active = False
            self.cur.clear_handles()
            self._stack.close()
            self._stack = None
            self.cur.calls = []
            self.cur.seen = {}
            self.cur.grads = {}
            self.naming.release()
            self._model_ref = self._optimizer_ref = self._scaler_ref = None
            with _LOCK:
                if _ACTIVE is self:
                    _ACTIVE = None

    def _final_flush(self) -> None:
        if self._trailing_evaluation():
            # forward-only work after the last training step is no step of its own: drop
            # its rows, keep the last step's late ones (parameters after update)
            self.recorder.discard_step(self._step)
            self.cur.transferred = True
            self.recorder.flush(self._step - 1, {})
        else:
            # a step cut between its backward and its optimizer step (Ctrl-C, a crash) has
            # no gradient norm: its gradients are still multiplied by GradScaler's scale, or
            # not yet clipped or reduced
            self._flush(norm=not self._cut_short())

    def _session_ending(self) -> None:
        """The last step is flushed and every hook is still installed (the sentinel analyses
        a failure it has not analysed yet)."""

    def _step_boundary(self, module: nn.Module, args: tuple) -> None:
        """A root module call begins a step: the previous step has returned to the user's
        loop (the sentinel analyses a failing step here)."""

    def _foreign_thread(self) -> bool:
        """A hook runs in a thread other than the training step's: it records nothing."""
        return threading.get_ident() != self._thread

    def _trailing_evaluation(self) -> bool:
        """The step in flight only evaluated (no_grad, inference_mode or eval-mode forwards, no
        backward, no optimizer or scaler step) after training steps: not a training step."""
        cur = self.cur
        trained = self._step > 0 and (self._saw_optimizer or self._optimizer_exists
                                      or self.scaler_seen or self._trained)
        return trained and not (cur.trains or cur.did_backward or cur.step_scaler
                                or self._optimizer_ran_step == self._step)

    def _cut_short(self) -> bool:
        """The step in flight ran a backward but not the optimizer step it was for."""
        return self.cur.did_backward and self._optimizer_ran_step != self._step and (
            self._saw_optimizer or self._optimizer_exists or self.scaler_seen)

    def __enter__(self) -> Session:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.stop()
        if exc is not None and self.first_failure is not None and hasattr(exc, "add_note"):
            exc.add_note(f"nanhunt: first non-finite value at {self.first_failure.where()}")
        return False

    def request_stop(self) -> None:
        """Ask a session with ``stop_on_problem`` to stop the script at the end of this step
        (another rank of a distributed run found a problem)."""
        self._stop_pending = True

    def end_step(self) -> None:
        """Mark a step boundary by hand (for loops that never call an optimizer)."""
        self._end_step()

    # -- installation -------------------------------------------------------------------

    def _install(self) -> None:
        with contextlib.ExitStack() as stack:  # (a failing install undoes what came before)
            for part in self._observers():
                part.install(stack)
            self._stack = stack.pop_all()
        model = self._model_ref() if self._model_ref else None
        if model is not None:
            self.naming.add_root(model, primary=True, label=type(model).__name__)
        self._active = True

    # -- shared by the observers ----------------------------------------------------------

    def _misuse(self, code: str, *, found_inf: bool = False, step: int | None = None) -> None:
        step = self._step if step is None else step
        rec = self.recorder.step_record(step)
        first_this_step = code not in rec.misuse
        if first_this_step:
            rec.misuse.append(code)
        call = self.loop_calls.get(code)
        if call is None:
            source, line = user_frame()
            self.loop_calls[code] = LoopCall(code, step, source, line or None,
                                             found_inf=found_inf)
        elif first_this_step:
            call.steps += 1
            call.found_inf = call.found_inf or found_inf

    def _allowed(self, module: str, tensor: str) -> bool:
        return any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(f"{module}.{tensor}", p)
                   for p in self.allow_inf)

    def _guard(self, fn: Any, *args: Any) -> Any:
        """Run nanhunt's part of a hook; a bug of ours must never break the user's training."""
        try:
            return fn(*args)
        except Exception as exc:
            self._internal_failure(exc)
            return None

    def _internal_failure(self, exc: Exception) -> None:
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
        self.internal_errors.append(f"{type(exc).__name__}: {exc}{where}")
        if self._active:
            self._active = False
            print(f"nanhunt: internal error ({type(exc).__name__}: {exc}{where}); tracing "
                  "stopped, your run continues", file=sys.stderr)

    def _on_failure(self, d: _StepData, origin_step: _StepData) -> None:
        """The judge found the first failure: stop at the end of the step, if asked."""
        self._stop_pending = True

    def _resolve_target(self, module: nn.Module) -> None:
        """Auto target: float16 as soon as autocast or a module's parameters use it (the
        narrower range wins), bfloat16 likewise; fixed after the first step either way."""
        p = next(module.parameters(recurse=False), None)
        device = p.device.type if p is not None else "cpu"
        found, source = None, ""
        enabled, dtype = _autocast_state(device)
        if enabled and dtype in _LOW:
            found, source = _LOW[dtype], "autocast"
        for q in module.parameters(recurse=False):
            if q.dtype in _LOW and (found is None or _LOW[q.dtype] == "float16"):
                found, source = _LOW[q.dtype], "parameters"
        if found is None or (found == self.target and self.target_source != "default"):
            return
        self.format = self.recorder.format = get_format(found)
        self.target, self.target_source = self.format.name, source
        if found == "float16":
            self._target_auto = False  # nothing narrower to find

    # -- step boundaries and the transfer ---------------------------------------------------

    def _end_step_if_over(self) -> None:
        """A new forward (or backward) after the optimizer ran starts a new step: several
        optimizers in one iteration stay one step, and a missing scaler.update() still ends it."""
        if self._in_closure:
            return  # the optimizer's closure: its forwards are the step in flight
        if self._optimizer_ran_step == self._step:
            self._end_step()
        elif self.cur.did_backward and not self._saw_optimizer and not self.cur.step_scaler \
                and not self._optimizer_exists:
            self._end_step()  # a loop with no optimizer: a new forward starts a new step

    def _end_step(self) -> None:
        if not self.cur.transferred:
            self._flush()
        self._target_auto = False  # one format for the whole run
        rec = self.recorder.step_record(self._step)
        rec.traced = self.cur.traced
        rec.lr = self.cur.lr if self.cur.lr is not None else self._current_lr()
        self._trained = self._trained or self.cur.did_backward
        self.cur.clear_handles()
        if self.on_step is not None:
            self.on_step(self.recorder.step_records[self._step], self)
        stop = self._stop_pending and self.stop_on_problem
        self._step += 1
        self._begin_step_state()
        if stop:
            self._stop_pending = False
            raise StopRun(f"nanhunt stopped the script after step {self._step - 1}, "
                          "where the first non-finite value appeared")
        if self.max_steps is not None and self._step >= self.max_steps:
            raise StopRun(f"nanhunt stopped the script after {self._step} steps (--max-steps)")

    def _current_lr(self) -> float | None:
        """The first optimizer's learning rate, read on the host: a scheduler that advances on
        steps GradScaler skipped shows as an lr that moves while nothing was applied."""
        return self._lr_of(self._lr_optimizer())

    def _lr_optimizer(self) -> Any:
        """The optimizer whose learning rate the steps record: the one given, else the first
        the script made."""
        ref = self._optimizer_ref or self._first_optimizer
        return ref() if ref is not None else None

    @staticmethod
    def _lr_of(opt: Any) -> float | None:
        if opt is None or not getattr(opt, "param_groups", None):
            return None
        lr = opt.param_groups[0].get("lr")
        if isinstance(lr, torch.Tensor):
            # a tensor lr on an accelerator would cost a sync: skip it
            return float(lr) if lr.device.type == "cpu" and lr.numel() == 1 else None
        return float(lr) if isinstance(lr, (int, float)) else None

    def _flush(self, norm: bool = True) -> None:
        """Move every queued row to the host in one transfer and digest it."""
        self.cur.transferred = True
        if norm:
            self.optimizer_obs.queue_grad_norm()
        self.recorder.flush(self._step, {c.id: c.parent for c in self.cur.calls})

    # -- derived views -------------------------------------------------------------------------

    def trace(self, run: RunInfo | None = None) -> Trace:
        """Everything recorded so far as a torch-free :class:`~nanhunt.trace.Trace`."""
        run = run or RunInfo()
        run.target = self.target
        run.target_source = run.target_source or self.target_source
        run.dtypes = sorted(self.dtypes)
        run.autocast = run.autocast or self.autocast_seen
        run.scaler = run.scaler or self.scaler_seen
        run.scaler_settings = run.scaler_settings or self.scaler_settings
        if not run.device:
            run.device = ", ".join(sorted(self.devices)) or "cpu"
        failure = copy.deepcopy(self.first_failure)
        if failure is not None and self.failure_extra.get("bad_samples"):
            failure.bad_samples = dict(self.failure_extra["bad_samples"])
            failure.batch_rows = self.failure_extra.get("batch_rows")
        if failure is not None and self.failure_extra.get("snapshot_error"):
            notes_extra = [f"the culprit was not copied for an op-level replay: "
                           f"{self.failure_extra['snapshot_error']}"]
        else:
            notes_extra = []
        notes = [f"nanhunt stopped tracing after an internal error: {e}"
                 for e in self.internal_errors] + notes_extra
        compiled = sorted(getattr(getattr(self, "modules", None), "compiled", ()))
        if self.aside is not False:
            notes.append("this session stood aside under nanhunt diagnose and recorded nothing: "
                         "nanhunt diagnose's own report has the run (first_failure is its)")
        for kind in dict.fromkeys(self.stood_aside):
            what = {"Sentinel": "a Sentinel: nanhunt.sentinel, or a callback in sentinel mode",
                    "Hunt": "a Hunt: nanhunt.watch, or a callback"}.get(kind, kind)
            notes.append(f"the script started a nanhunt session of its own ({what}); it stood "
                         "aside, recording nothing, because nanhunt diagnose traces this process")
        if self.recorder.reducer.failed:
            notes.append(
                "the statistics of sharded tensors (FSDP2 parameter gradients, the gradient "
                "norm) are this rank's shards' from the step the reduction across ranks failed "
                f"on: {self.recorder.reducer.failed}")
        comm = getattr(self, "comm", None)
        if comm is not None:
            comm.find_units()
            run.comm_hooks = run.comm_hooks or list(comm.comm_hooks)
            run.fsdp_policies = run.fsdp_policies or dict(comm.policies)
        if compiled:
            notes.append(
                f"compiled with torch.compile, seen only at the boundary: {', '.join(compiled)} "
                "(its inputs, outputs and their gradients; the modules inside ran in the "
                "compiled graph, unobserved, so that the run is the plain compiled run)")
        untraced = self.judge.untraced_failure
        if failure is None and untraced is not None:
            failure = copy.deepcopy(untraced)  # it never recurred: its origin was not observed
        elif failure is not None and untraced is not None and untraced.step < failure.step:
            notes.append(
                f"step {untraced.step} went non-finite ({untraced.tensor}) but --sample-every "
                "had not traced it; nanhunt traced the steps after it fully and located the "
                f"first failure there, at step {failure.step}")
        return Trace(
            run=run,
            steps=copy.deepcopy(self.steps),
            layers=self.layers,
            first_failure=failure,
            problem=failure is not None,
            facts=list(self.facts),
            scaler_events=list(self.scaler_events),
            grad_hist=self.grad_histograms(),
            layer_steps=self.recorder.layer_steps(),
            notes=notes,
            optimizers=copy.deepcopy(list(self.optimizer_infos.values())),
            loop_calls=copy.deepcopy(list(self.loop_calls.values())),
            crash=copy.deepcopy(self.crash),
            signals=self.recorder.signal_steps(),
            param_groups=copy.deepcopy(list(self.signals.groups.values())),
        )


class Hunt(Session):
    """Watch training steps and find the first non-finite value, with per-layer ranges.

    Use it as a context manager around one failing step or a whole loop, or call
    :meth:`start` and :meth:`stop`::

        import torch, nanhunt
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with nanhunt.watch(model, opt) as hunt:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()
        print(hunt.first_failure)          # None: every value was finite
        print(hunt.steps[-1].loss)         # the last step's loss
        print(hunt.layers[0].module)       # per-module ranges, execution order

    Reading the result: ``first_failure`` names the step (0-based), the phase (``data``,
    ``forward``, ``backward``, ``communication``, ``loss_scaling``, ``optimizer``), the
    module's qualified name
    as in ``model.named_modules()``, the tensor (``output[0]``, ``grad_input[0]``,
    ``fc.weight.grad``, ``loss``) and the values' summary. A module is blamed only when its
    inputs were finite; a non-finite value that a later module absorbed (a ``-inf`` attention
    mask) is recorded in ``facts``, not blamed. ``layers`` gives each module's forward and
    backward magnitude ranges, to read against the target format's limits
    (``headroom`` in binades below its max). ``steps`` has one record per step, including
    the steps GradScaler skipped.
    """


    def _compose(self) -> None:
        self.modules = ModuleObserver(self)
        self.autograd = AutogradObserver(self)
        self.comm = CommObserver(self)  # the gradients after the reduction across ranks
        self.signals.softmax = True  # attention logits: softmax inputs inside traced modules
        self.naming.on_param = self.autograd.hook_param
        if self.keep_tensors:  # a skipped step's culprit can be replayed without the scale
            self.judge.probe = self.snapshots.probe_unscaled

    def _observers(self) -> list[Any]:
        return [self.modules, self.autograd, self.comm, *super()._observers()]

    def _step_begun(self) -> None:
        if self.sample_every > 1 and self._stack is not None:
            # global module hooks slow every module call: sampled mode drops them between
            # sampled steps
            self.modules.set_hooks(self._full or not (self._saw_optimizer or self.scaler_seen))

    def _on_failure(self, d: _StepData, origin_step: _StepData) -> None:
        """Keep the culprit while its inputs are unchanged, and trace every step from now."""
        f = self.judge.first_failure
        if f is not None and f.phase == "backward" and not f.tensor.endswith(" (recomputed)") \
                and f.module in self.modules.recomputed.get(f.step, ()):
            # torch's non-reentrant checkpoint stops the recomputation once it has what backward
            # needs, before the module returns: its recomputed output is not observed
            f.detail = ((f.detail + "; ") if f.detail else "") + (
                f"{f.module}'s forward was recomputed by activation checkpointing in this "
                "backward, and this backward read the recomputed values (not observed: the "
                "recomputation stops before the module returns); a forward that does not give "
                "the same values twice makes this too")
        self.snapshots.take(d, origin_step)
        self._stop_pending = True
        self._full = True

    def start(self) -> Hunt:
        super().start()
        return self

    def __enter__(self) -> Hunt:
        return self.start()


@contextlib.contextmanager
def watch(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    target: str | None = "auto",
    **options: Any,
) -> Iterator[Hunt]:
    """Watch the training steps run inside the block; see :class:`Hunt`."""
    hunt = Hunt(model, optimizer, scaler, target=target, **options)
    with hunt:
        yield hunt
