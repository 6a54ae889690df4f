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
  fused gradient check); :mod:`.replay`: a kept step replayed under a Hunt on copies;
  :mod:`.sentinel`: :class:`Sentinel`, the cheap composition, and :func:`sentinel`.
"""

from __future__ import annotations

from typing import Any

# the old module's names stay importable from here (tests, benchmarks, other helpers)
from nanhunt import stats as _stats  # noqa: F401
from nanhunt.capture import session as _session
from nanhunt.capture._util import (  # noqa: F401
    _DROPOUT,
    _MAX_ANCESTOR_COPY,
    _WRAPPERS,
    _autocast_state,
    _call_leaves,
    _clone_tree,
    _foreach_norm,
    _in_backward,
    _leaves,
    _owner_of,
    _safe,
    _skip,
    _unwrap,
    _variable_name,
    _version,
    map_tensors,
    tensor_leaves,
)
from nanhunt.capture.recorder import _HIST_OFFSET, HISTORY  # noqa: F401
from nanhunt.capture.sentinel import Sentinel, sentinel
from nanhunt.capture.session import _LOCK, Hunt, Session, StopRun, watch  # noqa: F401
from nanhunt.capture.state import (  # noqa: F401
    Snapshot,
    StepState,
    _Call,
    _Frame,
    _LayerAcc,
    _merge_rows,
    _Meta,
    _StepData,
)

__all__ = ["Hunt", "Sentinel", "Session", "StopRun", "sentinel", "watch"]



def __getattr__(name: str) -> Any:
    # the session installed now lives in .session; read it live (a copy here would go stale)
    if name == "_ACTIVE":
        return _session._ACTIVE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
