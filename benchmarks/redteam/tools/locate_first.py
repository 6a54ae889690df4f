"""Independent reference locator (no nanhunt code): run a training script under a
TorchDispatchMode and report, in execution order, the first aten ops that
  * produce a non-finite floating output from all-finite floating inputs ("make-nonfinite"), and
  * cast a non-zero wider gradient into a narrower dtype as zero or subnormal ("flush").

For every event it prints: step, phase, module, op, dtype, the user's source line.

  phase:  forward   (outside backward / optimizer / scaler)
          backward  (inside the autograd engine: torch._C._current_autograd_node() is set)
          optimizer (inside any Optimizer.step: global optimizer step pre/post hooks)
          loss_scaling (inside GradScaler.scale / unscale_ / step / update, outside optimizer.step)
  module: forward -> innermost module whose forward is running (global forward pre/post hooks)
          backward -> the module whose forward created the autograd node now running (labelled
                      innermost-first from module forward hooks, by walking new grad_fn nodes)
  step:   number of completed optimizer steps + skipped scaler steps (GradScaler.update calls
          when a scaler exists, else Optimizer.step calls)

Usage: OMP_NUM_THREADS=1 python locate_first.py [--max-events N] [--flush] script.py [args]
Also prints per-step: loss-like scalars printed by the script pass through untouched.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback

import torch
from torch.nn.modules.module import (register_module_forward_hook,
                                     register_module_forward_pre_hook)
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

NARROW = (torch.float16, torch.bfloat16)


class State:
    def __init__(self):
        self.names: dict[int, str] = {}
        self.stack: list[str] = []
        self.node_label: dict[int, str] = {}
        self.node_refs = []  # keep nodes alive so ids stay unique
        self.in_opt = 0
        self.in_scaler = 0
        self.opt_steps = 0
        self.scaler_updates = 0
        self.scaler_seen = False
        self.events: list[dict] = []
        self.flushes: list[dict] = []
        self.root_count = 0
        self.script = None

    @property
    def step(self):
        return self.scaler_updates if self.scaler_seen else self.opt_steps


S = State()


def name_of(mod):
    n = S.names.get(id(mod))
    if n is None:
        # treat as a new root: name its whole tree
        label = "" if S.root_count == 0 else f"<{type(mod).__name__}>"
        S.root_count += 1
        for q, m in mod.named_modules():
            if id(m) not in S.names:
                S.names[id(m)] = (f"{label}.{q}" if label and q else (q or label))
        n = S.names[id(mod)]
    return n


def pre_hook(mod, args):
    S.stack.append(name_of(mod))


def post_hook(mod, args, out):
    name = S.stack.pop() if S.stack else name_of(mod)
    if torch.is_grad_enabled():
        ins = set()
        for a in tree_flatten(args)[0]:
            if isinstance(a, torch.Tensor) and a.grad_fn is not None:
                ins.add(id(a.grad_fn))
        todo = [o.grad_fn for o in tree_flatten(out)[0]
                if isinstance(o, torch.Tensor) and o.grad_fn is not None]
        seen = set()
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen or id(node) in ins:
                continue
            seen.add(id(node))
            if id(node) in S.node_label:
                continue
            S.node_label[id(node)] = name
            S.node_refs.append(node)
            for nxt, _ in node.next_functions:
                if nxt is not None:
                    todo.append(nxt)
    return None


def source_line():
    for fr in reversed(traceback.extract_stack()):
        if S.script and os.path.abspath(fr.filename) == S.script:
            return f"{os.path.basename(fr.filename)}:{fr.lineno}: {fr.line}"
    return None


def phase_and_module():
    node = torch._C._current_autograd_node()
    if node is not None:
        return "backward", S.node_label.get(id(node), f"<top:{type(node).__name__}>")
    if S.in_opt:
        return "optimizer", None
    if S.in_scaler:
        return "loss_scaling", None
    return "forward", (S.stack[-1] if S.stack else "<top>")


def finite_floats(ts):
    return all(bool(torch.isfinite(t).all()) for t in ts)


class Locator(TorchDispatchMode):
    def __init__(self, max_events, flush):
        super().__init__()
        self.max_events = max_events
        self.flush = flush

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "empty" in str(func) or func in (torch.ops.aten.set_.source_Storage_storage_offset,):
            return func(*args, **kwargs)  # uninitialised memory, not a computation
        ins = [a for a in tree_flatten((args, kwargs))[0]
               if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel()]
        check = len(S.events) < self.max_events
        # judge the inputs *before* the op runs (in-place ops overwrite them)
        ins_finite = finite_floats(ins) if check else True
        in_amax = max((float(a.detach().abs().max()) for a in ins), default=None) if check else None
        out = func(*args, **kwargs)
        outs = [o for o in tree_flatten(out)[0]
                if isinstance(o, torch.Tensor) and o.is_floating_point() and o.numel()]
        scal = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, float)]
        if any(v != v or v in (float("inf"), float("-inf")) for v in scal):
            check = False  # an intentional non-finite constant (masks, running-max init)
        if check and outs and ins_finite:
            bad = [o for o in outs if not bool(torch.isfinite(o).all())]
            if bad:
                phase, mod = phase_and_module()
                o = bad[0]
                scalars = [a for a in tree_flatten((args, kwargs))[0]
                           if isinstance(a, (int, float)) and not isinstance(a, bool)]
                S.events.append(dict(
                    step=S.step, phase=phase, module=mod, op=str(func), dtype=str(o.dtype),
                    nan=int(o.isnan().sum()), inf=int(o.isinf().sum()), numel=o.numel(),
                    in_amax=in_amax, scalars=scalars[:4], src=source_line()))
        if self.flush and func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype,
                                    torch.ops.aten.to.dtype_layout):
            if ins and outs and outs[0].dtype in NARROW and ins[0].dtype not in NARROW:
                phase, mod = phase_and_module()
                if phase == "backward" and len(S.flushes) < 12:
                    src, dst = ins[0], outs[0]
                    nz = src != 0
                    n = int(nz.sum())
                    if n:
                        tiny = float(torch.finfo(dst.dtype).tiny)
                        flushed = int((nz & (dst == 0)).sum())
                        sub = int((nz & (dst != 0) & (dst.abs() < tiny)).sum())
                        if flushed + sub:
                            S.flushes.append(dict(step=S.step, module=mod, op=str(func),
                                                  nonzero=n, flushed=flushed, subnormal=sub,
                                                  src_amax=float(src.abs().max())))
        return out


def install():
    register_module_forward_pre_hook(pre_hook)
    register_module_forward_hook(post_hook)

    def opre(opt, a, k):
        S.in_opt += 1

    def opost(opt, a, k):
        S.in_opt -= 1
        if not S.scaler_seen:
            S.opt_steps += 1

    register_optimizer_step_pre_hook(opre)
    register_optimizer_step_post_hook(opost)
    GS = torch.amp.GradScaler

    def wrap(name, counts_update=False):
        orig = getattr(GS, name)

        def w(self, *a, **k):
            S.scaler_seen = S.scaler_seen or self.is_enabled()
            S.in_scaler += 1
            try:
                return orig(self, *a, **k)
            finally:
                S.in_scaler -= 1
                if counts_update:
                    S.scaler_updates += 1
        setattr(GS, name, w)

    wrap("scale")
    wrap("unscale_")
    wrap("update", counts_update=True)
    orig_step = GS.step

    def step(self, optimizer, *a, **k):
        S.scaler_seen = S.scaler_seen or self.is_enabled()
        S.in_scaler += 1
        try:
            return orig_step(self, optimizer, *a, **k)
        finally:
            S.in_scaler -= 1
    GS.step = step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-events", type=int, default=6)
    ap.add_argument("--flush", action="store_true")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    o = ap.parse_args()
    S.script = os.path.abspath(o.script)
    sys.argv = [o.script] + o.args
    sys.path.insert(0, os.path.dirname(S.script))
    install()
    err = None
    with Locator(o.max_events, o.flush):
        try:
            runpy.run_path(o.script, run_name="__main__")
        except SystemExit:
            pass
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
            for fr in reversed(traceback.extract_tb(e.__traceback__)):
                if os.path.abspath(fr.filename) == S.script:
                    err += f" | at {os.path.basename(fr.filename)}:{fr.lineno}: {fr.line}"
                    break
    print("=== locate_first ===")
    if err:
        print("script raised:", err)
    for e in S.events:
        print("NONFINITE", e)
    for f in S.flushes:
        print("FLUSH", f)
    if not S.events:
        print("no op made a non-finite value from finite inputs")


if __name__ == "__main__":
    main()
