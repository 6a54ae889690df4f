"""An independent reference for the integration tests: run a training script under plain torch
instruments, none of nanhunt's code, and print what happened as JSON on the last stdout line.

    python tests/reference.py [--steps-only] SCRIPT [script args ...]

- ``first_bad``: the first aten op whose output is non-finite while every floating input was
  finite (a TorchDispatchMode over the whole run), with the step (backward passes so far) and
  the phase (``backward`` while the autograd engine runs it);
- ``casts``: per step, every backward down-cast (``_to_copy`` from float32 to float16 inside the
  autograd engine): values, already zero before, non-zero before and zero after (flushed),
  subnormal after;
- ``steps``: per backward pass, the L2 norm of each top-level child module's parameter
  gradients after backward (divided by the GradScaler scale when one is in use), whether
  GradScaler found inf (skipped) and the first optimizer's learning rate at ``update()``.
"""

from __future__ import annotations

import json
import runpy
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

STATE: dict = {"step": 0, "first_bad": None, "casts": [], "steps": [], "model": None}


def _floats(obj: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class FirstBadOp(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if STATE["first_bad"] is None:
            ins = _floats((args, kwargs))
            outs = _floats(out)
            if ins and outs and all(bool(torch.isfinite(t).all()) for t in ins) and any(
                    not bool(torch.isfinite(t).all()) for t in outs):
                STATE["first_bad"] = {"step": STATE["step"], "op": str(func.overloadpacket),
                                      "phase": "backward" if _in_backward() else "forward"}
        if func is torch.ops.aten._to_copy.default and _in_backward():
            src = args[0]
            if src.dtype == torch.float32 and out.dtype == torch.float16:
                nz = src != 0
                z = out == 0
                STATE["casts"].append({
                    "step": STATE["step"], "values": src.numel(),
                    "source_zero": int((~nz).sum()), "flushed": int((nz & z).sum()),
                    "subnormal": int(((out.abs() < torch.finfo(torch.float16).tiny) & ~z).sum()),
                })
        return out


def _model() -> torch.nn.Module | None:
    return STATE["model"]


_orig_backward = torch.Tensor.backward
_orig_update = torch.amp.GradScaler.update
_orig_module_call = torch.nn.Module.__call__


def _call(self, *args, **kwargs):
    if STATE["model"] is None and not _in_backward():
        STATE["model"] = self  # the first module called is the model
    return _orig_module_call(self, *args, **kwargs)


def _backward(self, *args, **kwargs):
    out = _orig_backward(self, *args, **kwargs)
    model = _model()
    norms = {}
    if model is not None:
        for name, child in model.named_children():
            grads = [p.grad.double().norm() for p in child.parameters() if p.grad is not None]
            if grads:
                norms[name] = float(torch.stack(grads).norm())
    STATE["steps"].append({"norms": norms, "skipped": None, "lr": None})
    STATE["step"] += 1
    return out


def _update(self, *args, **kwargs):
    found = sum(float(v) for st in self._per_optimizer_states.values()
                for v in st["found_inf_per_device"].values())
    scale = float(self._scale) if self._scale is not None else 1.0
    if STATE["steps"]:
        rec = STATE["steps"][-1]
        rec["skipped"] = found > 0
        rec["norms"] = {k: v / scale for k, v in rec["norms"].items()}
        rec["scale"] = scale
        opt = STATE.get("optimizer")
        if opt is not None:
            rec["lr"] = float(opt.param_groups[0]["lr"])
    return _orig_update(self, *args, **kwargs)


_orig_opt_init = torch.optim.Optimizer.__init__


def _opt_init(self, *args, **kwargs):
    _orig_opt_init(self, *args, **kwargs)
    STATE.setdefault("optimizer", self)


def main() -> None:
    dispatch = sys.argv[1] != "--steps-only"  # the dispatch mode is slow: skip it if unused
    script, *args = sys.argv[1:] if dispatch else sys.argv[2:]
    sys.argv = [script, *args]
    torch.Tensor.backward = _backward
    torch.amp.GradScaler.update = _update
    torch.nn.Module.__call__ = _call
    torch.optim.Optimizer.__init__ = _opt_init
    if dispatch:
        with FirstBadOp():
            runpy.run_path(script, run_name="__main__")
    else:
        runpy.run_path(script, run_name="__main__")
    for key in ("model", "optimizer"):
        STATE.pop(key, None)
    print(json.dumps(STATE))


if __name__ == "__main__":
    main()
