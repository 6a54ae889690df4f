"""The corpus's independent locator: benchmarks/redteam/tools/locate_first.py (a
TorchDispatchMode over every aten op, no nanhunt code), with its step counted the way a loop
with no torch optimizer counts them: one step per completed ``Tensor.backward``. With an
optimizer (or a GradScaler) the step is locate_first's own count.

Usage: python locate.py [--max-events N] script.py [args]   (prints locate_first's lines)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

_PATH = Path(__file__).resolve().parents[1] / "redteam" / "tools" / "locate_first.py"


def main() -> None:
    spec = importlib.util.spec_from_file_location("locate_first", _PATH)
    lf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lf)
    seen = {"optimizer": False, "backward": 0}
    init, backward = torch.optim.Optimizer.__init__, torch.Tensor.backward

    def optimizer_init(self, *args, **kwargs):
        seen["optimizer"] = True
        init(self, *args, **kwargs)

    def tensor_backward(self, *args, **kwargs):
        out = backward(self, *args, **kwargs)
        seen["backward"] += 1
        return out

    torch.optim.Optimizer.__init__ = optimizer_init
    torch.Tensor.backward = tensor_backward
    own = lf.State.step.fget
    lf.State.step = property(lambda s: own(s) if seen["optimizer"] or s.scaler_seen
                             else seen["backward"])
    lf.main()


if __name__ == "__main__":
    sys.exit(main())
