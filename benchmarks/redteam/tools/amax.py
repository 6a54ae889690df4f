"""Per-module forward output amax (float32 or as run), via global forward hooks; independent of nanhunt.
Usage: python amax.py script.py [args]  -> prints the top modules by amax per step (first 3 steps)."""
import os, runpy, sys, collections
import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
names = {}
root_n = [0]
rec = collections.defaultdict(dict)
step = [0]
def name_of(m):
    if id(m) not in names:
        lab = "" if root_n[0] == 0 else f"<{type(m).__name__}>"
        root_n[0] += 1
        for q, mm in m.named_modules():
            names.setdefault(id(mm), f"{lab}.{q}" if lab and q else (q or lab))
    return names[id(m)]
def post(m, a, o):
    if isinstance(o, tuple): o = o[0]
    if isinstance(o, torch.Tensor) and o.is_floating_point():
        n = name_of(m)
        v = float(o.detach().abs().float().nan_to_num(posinf=float('inf')).max())
        fin = bool(torch.isfinite(o).all())
        rec[step[0]][n] = (max(v, rec[step[0]].get(n, (0,))[0]), str(o.dtype).replace('torch.', ''), fin)
register_module_forward_pre_hook(lambda m, a: (name_of(m), None)[1])
register_module_forward_hook(post)
from torch.optim.optimizer import register_optimizer_step_post_hook
orig = torch.amp.GradScaler.update
def upd(self, *a, **k):
    r = orig(self, *a, **k); step[0] += 1; return r
torch.amp.GradScaler.update = upd
script = sys.argv[1]; sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
try:
    runpy.run_path(script, run_name="__main__")
except Exception as e:
    print("raised", e)
for s in sorted(rec)[:int(os.environ.get("NSTEPS", 3))]:
    top = sorted(rec[s].items(), key=lambda kv: -kv[1][0])[:int(os.environ.get("TOP", 8))]
    print("step", s, [(n, f"{v:.3g}", d, f) for n, (v, d, f) in top])
