"""Independent step counter (no nanhunt code): run a script as ``python script.py args`` would
and count what a training step is made of.

Counts optimizer steps (global optimizer step post-hooks), GradScaler.update calls and the
steps GradScaler skipped (the scale went down), and calls of Tensor.backward /
torch.autograd.backward. Writes the counts as JSON to the path in ``COUNT_STEPS_OUT`` when the
script ends (also on an exception or sys.exit). Usage::

    COUNT_STEPS_OUT=counts.json python count_steps.py script.py [args]
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

counts = {"optimizer_steps": 0, "scaler_updates": 0, "scaler_skips": 0, "backward_calls": 0,
          "optimizers": []}


def _opt_post(opt, args, kwargs):
    counts["optimizer_steps"] += 1
    name = type(opt).__name__
    if name not in counts["optimizers"]:
        counts["optimizers"].append(name)


def _wrap_update(original):
    def update(self, *a, **k):
        before = self.get_scale() if self.is_enabled() else None
        out = original(self, *a, **k)
        if before is not None:
            counts["scaler_updates"] += 1
            if self.get_scale() < before:
                counts["scaler_skips"] += 1
        return out

    return update


def _wrap_backward(original):
    def backward(*a, **k):
        counts["backward_calls"] += 1
        return original(*a, **k)

    return backward


def _write():
    path = os.environ.get("COUNT_STEPS_OUT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(counts, f)


def main() -> None:
    script, *args = sys.argv[1:]
    register_optimizer_step_post_hook(_opt_post)
    torch.amp.GradScaler.update = _wrap_update(torch.amp.GradScaler.update)
    torch.Tensor.backward = _wrap_backward(torch.Tensor.backward)
    atexit.register(_write)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
