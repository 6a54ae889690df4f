"""Scaler observer: ``GradScaler.update`` (found_inf, the scale before and after: the step ends
there), ``GradScaler.unscale_`` (whether gradients were unscaled before clipping) and
``GradScaler.step`` (whether an optimizer step is the scaler's own)."""

from __future__ import annotations

from typing import Any

import torch

from nanhunt.capture._util import patch
from nanhunt.capture.state import Part


class ScalerObserver(Part):
    """GradScaler's own bookkeeping, read as device scalars: a skipped step is seen here even
    though no optimizer hook fires for it."""

    def install(self, stack: Any) -> None:
        patch(stack, torch.amp.GradScaler, "update", self._wrap_update)
        patch(stack, torch.amp.GradScaler, "unscale_", self._wrap_unscale)
        patch(stack, torch.amp.GradScaler, "step", self._wrap_step)

    def _wrap_step(self, original: Any) -> Any:
        obs = self

        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            # an optimizer.step() that runs while this is > 0 is the scaler's own
            obs.s._in_scaler_step += 1
            try:
                return original(scaler, optimizer, *args, **kwargs)
            finally:
                obs.s._in_scaler_step -= 1

        step.__wrapped__ = original  # type: ignore[attr-defined]
        return step

    def _wrap_update(self, original: Any) -> Any:
        obs = self

        def update(scaler: Any, new_scale: Any = None) -> None:
            tracked = obs._guard(obs._before_update, scaler)
            result = original(scaler, new_scale)
            if tracked:
                obs._guard(obs._after_update, scaler)
            return result

        update.__wrapped__ = original  # type: ignore[attr-defined]
        return update

    def _before_update(self, scaler: Any) -> bool:
        if not (self.s._active and scaler.is_enabled() and scaler._scale is not None):
            return False
        self.s.scaler_seen = True
        if self.s.scaler_settings is None:  # as the script built it (advice keeps its choices)
            self.s.scaler_settings = {
                "init_scale": float(scaler._init_scale),
                "growth_factor": float(scaler._growth_factor),
                "backoff_factor": float(scaler._backoff_factor),
                "growth_interval": int(scaler._growth_interval)}
        found = [f for s in scaler._per_optimizer_states.values()
                 for f in s["found_inf_per_device"].values()]
        if found and not self.cur.step_scaler and self.cur.did_backward:
            self.s._misuse("unscaled_loss")
        if found:
            self.rec.scalar(sum(f.to(scaler._scale.device) for f in found), "found_inf")
        self.rec.scalar(scaler._scale.clone(), "scale_before")
        if self.cur.lr is None:  # a skipped step: the lr its optimizer would have stepped with
            self.cur.lr = self.s._current_lr()
        return True

    def _after_update(self, scaler: Any) -> None:
        self.rec.scalar(scaler._scale.clone(), "scale_after")
        self.s._updated_step, self.s._updated_params = self.s._step, self.cur.scaled_grad_params
        self.s._end_step()

    def _wrap_unscale(self, original: Any) -> Any:
        obs = self

        def unscale_(scaler: Any, optimizer: Any) -> None:
            obs.s._unscaled_step = obs.s._step
            return original(scaler, optimizer)

        unscale_.__wrapped__ = original  # type: ignore[attr-defined]
        return unscale_
