"""Communication observer: the gradients after their reduction across ranks (phase
``communication``).

- **DDP** reduces each gradient bucket with an all-reduce, through the communication hook the
  script registered (``register_comm_hook``: ``fp16_compress_hook`` casts the bucket to float16
  before the all-reduce) or DDP's own. ``Tensor.backward`` returns only once every bucket is
  reduced and copied back into ``.grad``, so right after it, on the training thread, each
  parameter's ``.grad`` is the reduced gradient (still scaled by GradScaler, not yet touched by
  the optimizer). One row per parameter, role ``reduced_grad``; the autograd observer's
  ``param_grad`` row of the same parameter is this rank's own gradient before the reduction.
  Backwards under ``no_sync()`` reduce nothing and get no rows.
- **FSDP2** reduce-scatters the unsharded gradient into each rank's shard; the sharded
  parameter's post-accumulate hook sees the result, so its ``param_grad`` row is put in this
  phase (by the autograd observer, through :meth:`CommObserver.fsdp_reduction`). The unsharded
  gradient before the reduce-scatter is not observed per parameter.
- **FSDP1** (``FullyShardedDataParallel``) reduce-scatters in its post-backward hook and sets
  each rank's shard as the ``.grad`` of its parameters without an accumulate hook firing: right
  after ``Tensor.backward`` returns, one ``param_grad`` row per parameter in this phase, on the
  local shard and reduced across ranks like FSDP2's (``use_orig_params=True``: the user's
  parameters by name; otherwise each unit's flat parameter, owned by the unit). Its
  ``MixedPrecision`` is read from each unit.

The hooks are read from each DDP instance (``_comm_hooks``: what is registered, a ``--fix``'s
swap included), and each FSDP2 unit's ``MixedPrecisionPolicy`` from its state, so the report
can name the reduction and the policy's dtypes.
"""

from __future__ import annotations

from typing import Any

import torch

from nanhunt import stats as _stats
from nanhunt.capture._util import _in_backward, _safe
from nanhunt.capture.naming import clean
from nanhunt.capture.state import Part, _Meta
from nanhunt.contract import is_fsdp1

__all__ = ["CommObserver", "hook_dtype", "hook_name"]

#: the dtype each of torch's compression hooks reduces in (by name)
_HOOK_DTYPES = {"fp16_compress_hook": "float16", "bf16_compress_hook": "bfloat16"}


def hook_name(hook: Any) -> str:
    """A communication hook's name (a ``functools.partial`` names the function it wraps)."""
    inner = getattr(hook, "func", hook)
    return str(getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None)
               or type(inner).__name__)


def hook_dtype(name: str) -> str | None:
    """The dtype a hook of torch's reduces in, from its name; None for a hook nanhunt does not
    know (PowerSGD, the script's own)."""
    return _HOOK_DTYPES.get(name.rsplit(".", 1)[-1])


def _ddp_class() -> Any:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except Exception:  # a torch without distributed
        return None
    return DistributedDataParallel


def _dtype_name(dtype: Any) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None


class CommObserver(Part):
    """Rows for the reduced gradients (see the module doc); ``comm_hooks`` lists the DDP hooks
    seen, ``policies`` each FSDP2 unit's mixed-precision policy by module name."""

    def __init__(self, session: Any) -> None:
        super().__init__(session)
        self.comm_hooks: list[str] = []
        self.policies: dict[str, dict[str, str | None]] = {}
        self._ddp = _ddp_class()
        self._units_seen: set[int] = set()
        # id(sharded parameter) -> (the unit's name, its reduce dtype)
        self._fsdp_params: dict[int, tuple[str, str | None]] = {}
        self._not_fsdp: set[int] = set()  # DTensor parameters no FSDP2 unit manages (TP)
        # FSDP1: id(parameter) -> (the unit's name, its reduce dtype)
        self.fsdp1_params: dict[int, tuple[str, str | None]] = {}

    # -- DDP ---------------------------------------------------------------------------------

    @_safe
    @torch.no_grad()
    def after_backward(self) -> None:
        """Called by the loss observer when ``Tensor.backward`` returns on the training thread."""
        s = self.s
        if self._ddp is None or not s._active or not s._full or _in_backward() \
                or s._foreign_thread():
            return
        for ref, _label in list(s.naming.roots):
            ddp = ref()
            if is_fsdp1(ddp):
                self._fsdp1_rows(ddp)
                continue
            if not isinstance(ddp, self._ddp) or not getattr(ddp, "require_backward_grad_sync",
                                                             True):
                continue
            hooks = [hook_name(h) for h, _state in getattr(ddp, "_comm_hooks", ())]
            for h in hooks:
                if h not in self.comm_hooks:
                    self.comm_hooks.append(h)
            how = "DDP all-reduce" + (f" through {', '.join(hooks)}" if hooks else "")
            known = [hook_dtype(h) for h in hooks]
            for p in ddp.module.parameters():
                g = p.grad
                if g is None or not _stats.summarizable(g):
                    continue
                name, owner = s.naming.param_names.get(p, ("", ""))
                if not name:
                    continue
                tensor = f"{name}.grad"
                dtype = _dtype_name(g.dtype)
                reduce_dtype = (known[0] if len(known) == 1 else None) if hooks else dtype
                s.judge.reductions[tensor] = (how, reduce_dtype)
                self.rec.queue(g, _Meta(
                    step=s._step, order=self.cur.next_order(), phase="communication",
                    module=owner, tensor=tensor, role="reduced_grad", dtype=str(dtype),
                    shape=tuple(g.shape), owner=owner))

    # -- FSDP1 -------------------------------------------------------------------------------

    def _fsdp1_rows(self, root: Any) -> None:
        """Each FSDP1 parameter's reduced shard, as a sharded ``param_grad`` row."""
        s = self.s
        if not self.fsdp1_params:
            self.find_units()
        label = s.naming.names.get(root, "")
        for full, p in root.named_parameters():
            g = p.grad
            if g is None and p.numel() == 0 and p.requires_grad:
                g = p.detach()  # an empty shard on this rank: a row all the same, as the peers
            if g is None or not _stats.summarizable(g):
                continue
            unit, reduce_dtype = self.fsdp1_params.get(id(p), ("", None))
            name, owner = s.naming.param_names.get(p, ("", ""))
            if not name:  # a flat parameter (use_orig_params=False): the unit owns it
                name = clean(full)
                owner = unit or label
            tensor = f"{name}.grad"
            where = f" of {unit or '<root>'}"
            s.judge.reductions[tensor] = (f"FSDP1 reduce-scatter{where}", reduce_dtype)
            self.cur.grad_params[id(p)] = p
            self.rec.queue(g, _Meta(
                step=s._step, order=self.cur.next_order(), phase="communication",
                module=owner, tensor=tensor, role="param_grad",
                dtype=str(g.dtype).removeprefix("torch."), shape=tuple(g.shape), owner=owner,
                sharded=True))

    # -- FSDP2 -------------------------------------------------------------------------------

    def fsdp_reduction(self, p: torch.Tensor, tensor: str) -> bool:
        """Whether ``p`` is a sharded FSDP2 parameter, whose accumulated gradient is the
        reduce-scatter's output (its row then belongs to the communication phase)."""
        if type(p).__name__ != "DTensor":
            return False
        if id(p) in self._not_fsdp:
            return False
        entry = self._fsdp_params.get(id(p))
        if entry is None:
            self.find_units()
            entry = self._fsdp_params.get(id(p))
        if entry is None:  # a DTensor of tensor parallelism: no reduce-scatter made it
            self._not_fsdp.add(id(p))
            return False
        unit, reduce_dtype = entry
        where = f" of {unit or '<root>'}"
        self.s.judge.reductions[tensor] = (f"FSDP2 reduce-scatter{where}", reduce_dtype)
        return True

    def _fsdp1_unit(self, root: Any, unit: Any) -> None:
        """An FSDP1 unit's MixedPrecision, and the parameters it manages."""
        mp = getattr(unit, "mixed_precision", None)
        name = "" if unit is root else self.s.naming.names.get(unit, "")
        param = _dtype_name(getattr(mp, "param_dtype", None))
        reduce = _dtype_name(getattr(mp, "reduce_dtype", None))
        self.policies[name] = {"param_dtype": param, "reduce_dtype": reduce,
                               "output_dtype": None, "api": "FSDP1"}
        for p in unit.parameters():
            # the innermost unit manages it: a nested unit is met after its parent
            self.fsdp1_params[id(p)] = (name, reduce or param)

    def find_units(self) -> None:
        """Each FSDP2 unit of the named roots: its policy and the parameters it shards."""
        for ref, _label in list(self.s.naming.roots):
            root = ref()
            if root is None:
                continue
            for module in root.modules():
                if is_fsdp1(module) and id(module) not in self._units_seen:
                    self._units_seen.add(id(module))
                    self._fsdp1_unit(root, module)
                    continue
                get_state = getattr(module, "_get_fsdp_state", None)
                if get_state is None or id(module) in self._units_seen:
                    continue
                self._units_seen.add(id(module))
                try:
                    state = get_state()
                    policy = state._mp_policy
                    group = state._fsdp_param_group
                    params = [fp.sharded_param for fp in group.fsdp_params] if group else []
                except Exception:  # another torch's internals: the phase still holds
                    continue
                # "": the root itself (its modules' names carry no prefix)
                name = "" if module is root else self.s.naming.names.get(module, "")
                param_dtype = _dtype_name(policy.param_dtype)
                reduce_dtype = _dtype_name(policy.reduce_dtype) or param_dtype
                self.policies[name] = {
                    "param_dtype": param_dtype,
                    "reduce_dtype": _dtype_name(policy.reduce_dtype),
                    "output_dtype": _dtype_name(policy.output_dtype),
                }
                for p in params:
                    self._fsdp_params[id(p)] = (name, reduce_dtype)
