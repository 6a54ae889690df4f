"""Per-module unscaled gradient norms per step (independent of nanhunt): wraps GradScaler.step /
Optimizer.step to read .grad right before the update decision. Usage: python gradnorms.py script [args]"""
import os, runpy, sys, math
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
rows = []
models = []
orig_init = torch.nn.Module.__init__
state = {"step": 0}
def norms(opt, inv):
    out = {}
    for g in opt.param_groups:
        for p in g["params"]:
            if p.grad is None: continue
            out.setdefault(id(p), float(p.grad.detach().float().norm()) * inv)
    return out
GS = torch.amp.GradScaler
o_step = GS.step
def step(self, opt, *a, **k):
    S = self.get_scale() if self.is_enabled() else 1.0
    rec(opt, 1.0 / S, tag="scaler")
    return o_step(self, opt, *a, **k)
GS.step = step
pnames = {}
def rec(opt, inv, tag):
    if not pnames:
        import gc
        for obj in gc.get_objects():
            if isinstance(obj, torch.nn.Module) and next(obj.parameters(), None) is not None:
                for n, p in obj.named_parameters():
                    if id(p) not in pnames or len(n) > len(pnames[id(p)]):
                        pnames[id(p)] = n
    ns = norms(opt, inv)
    by_mod = {}
    for pid, v in ns.items():
        mod = pnames.get(pid, "?").rsplit(".", 1)[0]
        by_mod[mod] = by_mod.get(mod, 0.0) + v * v
    tot = math.sqrt(sum(by_mod.values()))
    print(f"[gradnorm {tag} #{state['step']}] total {tot:.3g} " + " ".join(f"{m}={math.sqrt(v):.3g}" for m, v in by_mod.items()), flush=True)
    state["step"] += 1
def pre(opt, a, k):
    if not getattr(opt, "_via_scaler", False) and not any(isinstance(x, GS) for x in []):
        pass
register_optimizer_step_pre_hook(lambda opt, a, k: None)
script = sys.argv[1]; sys.argv = sys.argv[1:]
if os.environ.get("NOSCALER"):
    from torch.optim.optimizer import register_optimizer_step_pre_hook as r
    r(lambda opt, a, k: rec(opt, 1.0, "opt"))
runpy.run_path(script, run_name="__main__")
