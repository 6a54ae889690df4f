"""The corpus's independent locator: benchmarks/redteam/tools/locate_first.py (a
TorchDispatchMode over every aten op, no nanhunt code), with its step counted the way a loop
with no torch optimizer counts them: one step per completed ``Tensor.backward`` (with an
optimizer or a GradScaler, locate_first's own count), and the forward and backward an
optimizer step's closure runs (Lightning, LBFGS) in their own phases, not the optimizer's.

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
    install = lf.install

    def install_with_closures():
        install()

        # an optimizer step's closure (Lightning's automatic optimisation, LBFGS) runs the
        # training step's forward and backward: those ops are not the optimizer's
        def outside(closure):
            def run(*args, **kwargs):
                depth, lf.S.in_opt = lf.S.in_opt, 0
                try:
                    return closure(*args, **kwargs)
                finally:
                    lf.S.in_opt = depth
            return run

        def pre(optimizer, args, kwargs):
            if callable(kwargs.get("closure")):
                return args, {**kwargs, "closure": outside(kwargs["closure"])}
            if len(args) > 1 and callable(args[1]):
                return (args[0], outside(args[1]), *args[2:]), kwargs
            return None

        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(pre)

    lf.install = install_with_closures
    own = lf.State.step.fget
    lf.State.step = property(lambda s: own(s) if seen["optimizer"] or s.scaler_seen
                             else seen["backward"])
    lf.main()


if __name__ == "__main__":
    sys.exit(main())
