"""Live capture: observers that see a training step's tensors, the recorder, the judge, and the
sessions that compose them.

Layout (which file owns which hook):

- :mod:`.modules`: global module forward pre/post hooks (inputs, outputs, the call tree);
- :mod:`.autograd`: ``Tensor.register_hook`` on recorded outputs, parameter
  post-accumulate-grad hooks;
- :mod:`.loss`: ``Tensor.backward`` and ``GradScaler.scale`` wrappers (the loss, its targets);
- :mod:`.optimizer`: global optimizer step pre/post hooks, ``Optimizer.__init__``,
  ``clip_grad_norm_`` (the transfer, updated parameters, gradient norm);
- :mod:`.scaler`: ``GradScaler.update`` and ``GradScaler.unscale_`` (found_inf, scale);
- :mod:`.recorder`: queued rows, the per-step transfer, the ring buffer, timeline, layer ranges;
- :mod:`.judge`: problem per step, first failure; :mod:`.snapshot`: the culprit's copy;
- :mod:`.naming`: module and parameter names; :mod:`.state`: shared records and step state;
- :mod:`.session`: :class:`Session` (the ExitStack, step boundaries), :class:`Hunt` (full
  tracing) and :func:`watch`;
- :mod:`.keep`: the sentinel's cheap parts (root inputs, loss and targets kept by reference; one
  fused gradient check); :mod:`.sentinel`: :class:`Sentinel`, the cheap composition, which
  records a failing step in its hooks for an analyst injected from above
  (``nanhunt.Sentinel`` = this one with :class:`nanhunt.replay.step.TripAnalyst`).
"""

from __future__ import annotations

from typing import Any

from nanhunt.capture import session as _session
from nanhunt.capture.sentinel import Sentinel
from nanhunt.capture.session import Hunt, Session, StopRun, watch

__all__ = ["Hunt", "Sentinel", "Session", "StopRun", "watch"]


def __getattr__(name: str) -> Any:
    # the session installed now lives in .session; read it live (a copy here would go stale)
    if name == "_ACTIVE":
        return _session._ACTIVE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
