"""Optimizer observer: global optimizer step pre/post hooks (the step's transfer, the updated
parameters, the step end), ``Optimizer.__init__`` (an optimizer exists) and ``clip_grad_norm_``
(the norm before clipping)."""

from __future__ import annotations

import copy
import math
import weakref
from typing import Any

import torch
from torch.optim import optimizer as _O

from nanhunt import stats as _stats
from nanhunt.capture._util import (
    _foreach_amax,
    _foreach_norm,
    _safe,
    _variable_path,
    patch,
    user_frame,
)
from nanhunt.capture.shards import is_sharded
from nanhunt.capture.state import OptimizerSnapshot, Part, _Meta
from nanhunt.trace import OptimizerInfo

#: parameter formats whose optimizer steps are copied before they run (to replay a failing one)
_COPIED_DTYPES = (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
#: elements of parameters beyond which an optimizer is not copied every step
_MAX_OPTIMIZER_COPY = 50_000_000


class _Closure:
    """The closure an optimizer step runs (Lightning's training step, LBFGS's re-evaluation):
    forwards inside it belong to the step in flight, and the step's transfer follows its first
    call, before the optimizer changes the weights. It returns exactly what the closure
    returns."""

    def __init__(self, session: Any, fn: Any) -> None:
        self.s, self.fn, self.calls = session, fn, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.s._in_closure += 1
        try:
            result = self.fn(*args, **kwargs)
        finally:
            self.s._in_closure -= 1
        self.calls += 1
        if self.calls == 1 and self.s._active:
            self.s._guard(self.s._flush)
        return result


class OptimizerObserver(Part):
    """What an optimizer step does: before it, the step's one transfer (the weights are about
    to change); after it, each updated parameter's amax and finiteness from one fused kernel per
    device; the gradient norm the optimizer stepped on."""

    def __init__(self, session: Any, *, check_params: bool = True,
                 measure_grads: bool = True) -> None:
        super().__init__(session)
        self._closure: _Closure | None = None
        self._extra = False  # the step in flight is optimizer.step() after scaler.update()
        self.check_params = check_params  # rows for the updated parameters
        self.measure_grads = measure_grads  # the gradient norm, unless measured already

    def install(self, stack: Any) -> None:
        stack.enter_context(_O.register_optimizer_step_pre_hook(self._on_opt_pre))
        stack.enter_context(_O.register_optimizer_step_post_hook(self._on_opt_post))
        patch(stack, torch.optim.Optimizer, "__init__", self._wrap_optimizer_init)
        patch(stack, torch.optim.Optimizer, "zero_grad", self._wrap_zero_grad)
        clip = self._wrap_clip(torch.nn.utils.clip_grad_norm_)
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
            if getattr(owner, "clip_grad_norm_", None) is not None:
                stack.callback(setattr, owner, "clip_grad_norm_", owner.clip_grad_norm_)
                owner.clip_grad_norm_ = clip

    @_safe
    def _on_opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        if not self.s._active or self.s._foreign_thread():
            return None
        self.s._saw_optimizer = True
        self.s._optimizers_seen.add(id(optimizer))
        if id(optimizer) not in self.s.optimizer_infos:
            self._describe(optimizer)
        scaler = self.s._scaler_ref() if self.s._scaler_ref is not None else None
        if self.cur.step_scaler and scaler is not None and scaler.is_enabled() and \
                not self.s._in_scaler_step:
            self._outside_scaler_step(optimizer, scaler)
        elif scaler is not None and scaler.is_enabled() and self._after_update(optimizer):
            self._extra = True
            return None  # part of the step scaler.update() ended, not a step of its own
        # (args[0] is the optimizer itself: a positional closure is args[1])
        closure = callable(kwargs.get("closure")) or (len(args) > 1 and callable(args[1]))
        if self.s.keep_tensors and self.judge.first_failure is None and not closure and \
                self.s.optimizer_snapshot is None and self.check_params:
            self._copy_before_step(optimizer)
        self.s._optimizer_ran_step = self.s._step
        if self.cur.lr is None and optimizer is self.s._lr_optimizer():
            self.cur.lr = self.s._lr_of(optimizer)  # what it steps with (global pre-hooks ran)
        self.rec.data_for(self.s._step).optimizer_ran = True  # known on the host: no transfer
        # the norm of what this optimizer steps on (a GAN's other model may hold gradients
        # that no optimizer uses, still scaled)
        self.cur.opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        # args[0] is the optimizer itself; a closure comes as closure= (Lightning) or as the
        # first positional argument (LBFGS's optimizer.step(closure))
        if callable(kwargs.get("closure")):
            self.s._closure_step = self.s._step
            self._closure = _Closure(self.s, kwargs["closure"])
            return args, {**kwargs, "closure": self._closure}
        if len(args) > 1 and callable(args[1]):
            self.s._closure_step = self.s._step
            self._closure = _Closure(self.s, args[1])
            return (args[0], self._closure, *args[2:]), kwargs
        self._closure = None
        self.s._flush()  # the step's one transfer, before the update changes the weights
        return None

    @_safe
    def _on_opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.s._active or self.s._foreign_thread():
            return
        if self._extra:
            self._extra = False
            if self.check_params:  # what the repeated update made of the weights
                self._queue_params([p for group in optimizer.param_groups
                                    for p in group["params"]
                                    if _stats.summarizable(p) and not p.is_sparse])
            return
        if self.s._closure_step == self.s._step:
            # rows of the closure's later calls (LBFGS calls it several times); the gradient
            # norm went with the first call's transfer
            closure, self._closure = self._closure, None
            self.s._flush(norm=closure is None or not closure.calls)
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None and _stats.summarizable(p) and not p.is_sparse]
        if params and self.check_params:
            finite = self._queue_params(params)
            pending = self.cur.optimizer_copy
            if pending is not None and pending[0] == id(optimizer):
                self.cur.optimizer_copy = None
                # (a device sync, only for the few optimizers copied: low-precision weights)
                if not bool(finite.all()):
                    self.s.optimizer_snapshot = pending[1]
        # with one optimizer the step ends here (so a distributed run agrees on stopping
        # while every rank is still in step); once several optimizers step, at the next
        # forward: a GAN's second optimizer belongs to the same iteration
        if not self.cur.step_scaler and len(self.s._optimizers_seen) == 1:
            self.s._end_step()

    def _wrap_optimizer_init(self, original: Any) -> Any:
        obs = self

        def __init__(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            obs.s._optimizer_exists = True  # micro-batches before its first step are one step
            out = original(optimizer, *args, **kwargs)
            if obs.s._first_optimizer is None or obs.s._first_optimizer() is None:
                obs.s._first_optimizer = weakref.ref(optimizer)  # whose lr the steps record
            return out

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        return __init__

    def _wrap_zero_grad(self, original: Any) -> Any:
        obs = self

        def zero_grad(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            obs._guard(obs._before_zero_grad, optimizer)
            return original(optimizer, *args, **kwargs)

        zero_grad.__wrapped__ = original  # type: ignore[attr-defined]
        return zero_grad

    def _before_zero_grad(self, optimizer: Any) -> None:
        """zero_grad() after scaler.unscale_(optimizer) and before scaler.step(optimizer): the
        step that follows finds no gradient and applies nothing, every step."""
        s = self.s
        scaler = s._scaler_ref() if s._scaler_ref is not None else None
        if not s._active or scaler is None or not scaler.is_enabled() \
                or s._unscaled_step != s._step or s._in_scaler_step:
            return
        state = scaler._per_optimizer_states.get(id(optimizer))
        if state is not None and getattr(state.get("stage"), "name", "") == "UNSCALED":
            s._misuse("zero_grad_after_unscale")

    def _wrap_clip(self, original: Any) -> Any:
        obs = self

        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            if obs.s._active and obs.cur.step_scaler and obs.s._unscaled_step != obs.s._step:
                obs.s._misuse("clip_on_scaled_grads")
            total = original(*args, **kwargs)
            if obs.s._active and isinstance(total, torch.Tensor):
                # the norm before clipping: what the step's gradients really were
                obs.cur.clip_norm = total.detach()
            return total

        clip_grad_norm_.__wrapped__ = original  # type: ignore[attr-defined]
        return clip_grad_norm_

    def _describe(self, optimizer: Any) -> None:
        """Its class and first group's lr, eps and beta2, once: what a step's arithmetic uses."""
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        source, line = user_frame()

        def number(key: str) -> float | None:
            v = group.get(key)
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = float(v)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        betas = group.get("betas")
        beta2 = betas[1] if isinstance(betas, (tuple, list)) and len(betas) == 2 else None
        if isinstance(beta2, torch.Tensor) and beta2.numel() == 1:
            beta2 = float(beta2)
        self.s.optimizer_infos[id(optimizer)] = OptimizerInfo(
            type=type(optimizer).__name__, lr=number("lr"), eps=number("eps"),
            beta2=float(beta2) if isinstance(beta2, (int, float)) else None,
            param_dtypes=sorted({str(p.dtype).removeprefix("torch.") for p in params}),
            params=len(params), source=source, source_line=line or None,
            name=_variable_path(optimizer))

    def _after_update(self, optimizer: Any) -> bool:
        """optimizer.step() after scaler.update(), before any forward or backward of the next
        step (a line left over from the loop before AMP): it applies the gradients of the step
        that just ended again, the inf/NaN ones GradScaler skipped included."""
        s, prev = self.s, self.s._step - 1
        if s._in_scaler_step or s._updated_step != prev or self.cur.did_backward \
                or self.cur.calls:
            return False
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not any(id(p) in s._updated_params for p in params):
            return False
        # one sync, on a misuse only: are the gradients it applies the ones GradScaler refused?
        found_inf = any(not bool(torch.isfinite(p.grad).all())
                        for p in params if p.grad is not None)
        if found_inf:
            self.rec.data_for(prev).applied_anyway = True
        s._misuse("optimizer_stepped_twice", found_inf=found_inf, step=prev)
        return True

    def _outside_scaler_step(self, optimizer: Any, scaler: Any) -> None:
        """optimizer.step() called by the user's loop while GradScaler scales its gradients."""
        owns = any(id(p) in self.cur.scaled_grad_params
                   for g in optimizer.param_groups for p in g["params"])
        if not owns:  # (an fp32 side model may step on its own, unscaled loss)
            return
        state = scaler._per_optimizer_states.get(id(optimizer))
        stage = getattr(state.get("stage"), "name", "READY") if state else "READY"
        if stage == "READY":  # nothing unscaled them: every update is the scale times too big
            self.s._misuse("optimizer_on_scaled_grads")
            return
        # unscaled (scaler.unscale_) or already stepped: GradScaler's inf check was made, and
        # this step applies the gradients it found inf/NaN in (one sync, on a misuse only)
        found = list(state["found_inf_per_device"].values()) if state else []
        found_inf = bool(sum(float(f) for f in found)) if found else False
        if found_inf:
            self.rec.data_for(self.s._step).applied_anyway = True
        # STEPPED: scaler.step(optimizer) already ran this step, and this is a second step
        code = "optimizer_stepped_twice" if stage == "STEPPED" else \
            "optimizer_outside_scaler_step"
        self.s._misuse(code, found_inf=found_inf)

    def _copy_before_step(self, optimizer: Any) -> None:
        """Low-precision parameters: keep a copy of what this step reads, to replay it when it
        makes a parameter non-finite (an eps that is 0 in float16 does so on the first step)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not any(p.dtype in _COPIED_DTYPES for p in params):
            return
        if sum(p.numel() for p in params) > _MAX_OPTIMIZER_COPY:
            return
        memo: dict[int, Any] = {}
        for p in params:
            c = p.detach().clone().requires_grad_(p.requires_grad)
            if p.grad is not None:
                c.grad = p.grad.detach().clone()
            memo[id(p)] = c
        try:
            copied = copy.deepcopy(optimizer, memo)
        except Exception:  # an optimizer that cannot be copied is not replayed
            return
        self.cur.optimizer_copy = (id(optimizer), OptimizerSnapshot(
            copied, self.s._step, type(optimizer).__name__))

    @torch.no_grad()
    def _queue_params(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Updated parameters, cheaply: one fused max-norm kernel per device gives each one's
        amax, and NaN/inf when it went non-finite; a culprit is summarised exactly later.
        Returns whether each parameter is finite (on the device; nothing waits for it)."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in params:
            by_device.setdefault(p.device, []).append(p)
        finite = []
        for device, ps in by_device.items():
            norms = _foreach_amax(ps)
            finite.append(torch.isfinite(norms).all().reshape(1).cpu()
                          if self.cur.optimizer_copy is not None else
                          torch.ones(1, dtype=torch.bool))
            rows = torch.zeros((len(ps), _stats.ROW_LEN), dtype=torch.float64, device=device)
            # numel is filled in on the host (no host-to-device copy here)
            rows[:, 1] = torch.isnan(norms).double()
            rows[:, 2] = torch.isinf(norms).double()
            rows[:, 5] = torch.where(torch.isfinite(norms), norms, 0.0)
            rows[:, 6] = math.inf
            self.rec.pending_rows.extend(rows.unbind(0))
            for p in ps:
                name, owner = self.s.naming.param_names.get(p, ("<param>", ""))
                self.rec.metas.append(_Meta(
                    step=self.s._step, order=self.cur.next_order(), phase="optimizer",
                    module=owner,
                    tensor=name, role="param", dtype=str(p.dtype).removeprefix("torch."),
                    shape=tuple(p.shape), owner=owner, approx=weakref.ref(p)))
                self.rec.dtypes.add(str(p.dtype).removeprefix("torch."))
        return torch.cat(finite) if finite else torch.ones(1, dtype=torch.bool)

    @torch.no_grad()
    def queue_grad_norm(self) -> None:
        """The global norm of the gradients the optimizer sees (already unscaled by GradScaler
        when it runs), one fused kernel per device."""
        if self.cur.clip_norm is not None:  # clip_grad_norm_ measured it already, unclipped
            self.rec.scalar(self.cur.clip_norm.double().pow(2), "grad_sumsq")
            self.cur.clip_norm, self.cur.grad_params, self.cur.opt_params = None, {}, None
            return
        if not self.measure_grads:
            self.cur.grad_params, self.cur.opt_params = {}, None
            return
        params = self.cur.opt_params if self.cur.opt_params is not None else \
            self.cur.grad_params.values()
        params = [p for p in params if p.grad is not None]
        self.cur.grad_params, self.cur.opt_params = {}, None
        if not params:
            return
        # a sharded gradient's sum of squares is this rank's shard's: the recorder adds the
        # ranks' up (capture/shards.py); FSDP1's shards are plain tensors, known by parameter
        comm = getattr(self.s, "comm", None)
        fsdp1 = comm.fsdp1_params if comm is not None else {}
        shard = [is_sharded(p.grad) or id(p) in fsdp1 for p in params]
        for key, part_grads in (("grad_sumsq", [p.grad for p, sh in zip(params, shard)
                                                if not sh]),
                                ("grad_sumsq_sharded", [p.grad for p, sh in zip(params, shard)
                                                        if sh])):
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for g in part_grads:
                if not g.is_sparse:
                    by_device.setdefault(g.device, []).append(g)
            total = None
            for device_grads in by_device.values():
                norms = torch.stack(_foreach_norm(device_grads, 2.0))
                part = norms.double().pow(2).sum()
                total = part if total is None else total + part.to(total.device)
            if total is not None:
                self.rec.scalar(total, key)
