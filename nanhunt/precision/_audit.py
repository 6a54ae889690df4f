"""The audit's measurements: replay each traced step in float32 and in every target format.

For each step the loss depends on, the tape (``_tape.py``) is replayed once in float32 and once
per target. A target replay reproduces what the run computed when the run itself used that
format (``measured``), or simulates it (``simulated``: autocast with the target for an fp32 run,
the model cast for a ``model.half()`` run, FP8 by rounding GEMM inputs, weights and outputs).
Each module call of a target replay is also replayed alone in float32 on float32 copies of its
inputs (``_observe.py``). Nothing of the user's changes: parameters are passed to
``functional_call``, buffers copied, gradients taken with ``torch.autograd.grad``, the
generators (torch's, Python's, numpy's) put back, and the modules' other Python attributes
stood in for while the replays run (``_state.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nanhunt.analyse import rank
from nanhunt.capture.compiled import compiled_run_eagerly
from nanhunt.capture.naming import Naming
from nanhunt.formats import get_format
from nanhunt.precision._observe import Measured, Observer, Plan, energies, is_gemm, round_to
from nanhunt.precision._state import ModuleState, module_state_kept
from nanhunt.precision._tape import Entry, Tape, autocast_pinned, rng_kept
from nanhunt.trace import PrecisionAudit, PrecisionLayer, PrecisionLoss

__all__ = ["Auditor"]

_LOW = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


@dataclass
class _Sums:
    local: list[float] = field(default_factory=lambda: [0.0, 0.0])
    e2e: list[float] = field(default_factory=lambda: [0.0, 0.0])
    e2e_in: list[float] = field(default_factory=lambda: [0.0, 0.0])  # its floating inputs
    grad: list[float] = field(default_factory=lambda: [0.0, 0.0])
    has_grad: bool = False
    calls: int = 0
    nonfinite: int = 0


@dataclass
class _TargetState:
    name: str
    plan: Plan | None = None
    sums: dict[str, _Sums] = field(default_factory=lambda: defaultdict(_Sums))
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)
    analysis: dict[str, dict[str, float]] = field(default_factory=dict)
    losses: list[PrecisionLoss] = field(default_factory=list)
    reproduced: bool | None = None
    seconds: float = 0.0


class Auditor:
    """Measures traced steps; ``result()`` ranks the layers and checks the advice."""

    def __init__(self, targets: list[str] | None) -> None:
        self.requested = targets
        self.tape = Tape()
        # the same names as a diagnosis of the same run (a callback's report holds both): the
        # first root with parameters unprefixed, DDP wrappers unwrapped
        self.naming = Naming()
        self.observer = Observer(self._name)
        self.states: list[_TargetState] = []
        self.steps = 0
        self.notes: list[str] = []
        # every audited step's tape entries and loss, for checking advice on all their batches
        self.kept: list[tuple[list[Entry], torch.Tensor]] = []
        self._b_loss: float | None = None
        self._scaled: dict[int, torch.Tensor] = {}  # id(scaled loss) -> the loss
        self.device = ""

    # -- naming -------------------------------------------------------------------------

    @property
    def names(self) -> Any:
        """module -> its name, as ``nanhunt diagnose`` names it (capture's :class:`Naming`)."""
        return self.naming.names

    def name_root(self, root: nn.Module, label: str) -> None:
        if root not in self.naming.names:
            self.naming.add_root(root, label=label)

    def _name(self, module: nn.Module) -> str:
        return self.names.get(module) or f"<{type(module).__name__}>"

    def note_scaled(self, scaled: torch.Tensor, loss: torch.Tensor) -> None:
        self._scaled[id(scaled)] = loss

    # -- plans ----------------------------------------------------------------------------

    def _plans(self, entries: list[Entry]) -> None:
        if self.states:
            return
        low_params = {p.dtype for e in entries if e.module for p in e.fn.parameters()
                      if p.dtype in _LOW}
        auto = {d for e in entries for on, d in e.autocast.values() if on and d in _LOW}
        auto |= {d for d in self.observer.run_autocast if d in _LOW}
        run_low = next(iter(auto or low_params), None)
        run_name = _LOW.get(run_low) if run_low is not None else None
        kind = _device_kind(entries)
        self.device = next((str(p.device) for e in entries if e.module
                            for p in e.fn.parameters()), kind)
        targets = self.requested or [run_name or "float16"]
        for t in targets:
            fmt = get_format(t)
            state = _TargetState(fmt.name)
            if fmt.name == run_name:
                state.plan = Plan(fmt, True, f"the run's own {fmt.name} ("
                                  + ("autocast" if auto else "model in " + fmt.name) + ")")
            elif fmt.name in _FP8:
                state.plan = Plan(
                    fmt, False,
                    f"{fmt.name} by rounding the inputs, weights and outputs of every Linear/Conv "
                    "(per-tensor power-of-two scaling, gradients at those boundaries too); the "
                    "rest in float32", param_dtype=torch.float32, input_from=run_low,
                    input_to=torch.float32, fp8=_FP8[fmt.name])
            elif fmt.name == "float32":
                raise_bad(f"--target {fmt.name}: the audit compares a format against float32")
            elif low_params:
                dt = getattr(torch, fmt.name)
                state.plan = Plan(fmt, False, f"the model and batch cast to {fmt.name}",
                                  param_dtype=dt, input_from=run_low, input_to=dt,
                                  autocast_dtype=dt if auto else None)
            else:
                dt = getattr(torch, fmt.name)
                state.plan = Plan(fmt, False, f"torch.autocast({kind!r}, {fmt.name}) over the "
                                  f"whole step, with {kind.upper()} autocast's op lists",
                                  autocast_dtype=dt)
                if run_low is not None:
                    state.plan.input_from, state.plan.input_to = run_low, torch.float32
            if low_params and state.plan.fp8 is None:
                # a float32 module in a half model: what follows expects the model's dtype
                state.plan.cast_to = state.plan.param_dtype or run_low
            self.states.append(state)

    # -- one step ------------------------------------------------------------------------

    def measure(self, tensor: torch.Tensor, gradient: torch.Tensor | None = None) -> bool:
        """Audit the step whose backward starts at ``tensor``; False when it is not the
        model's (no tape entry made it)."""
        entries = self.tape.needed(tensor)
        if not entries:
            return False
        for e in entries:
            if e.module:
                self.name_root(e.fn, type(e.fn).__name__)
        self._plans(entries)
        loss = self._scaled.get(id(tensor))
        if loss is None or not self.tape.tracks(loss):
            loss = tensor
        self.steps += 1
        with rng_kept(), module_state_kept(_roots(entries)), torch.enable_grad():
            b, env_b = self._replay(entries, None)
            grads_b = _grads(env_b.get(id(tensor)), b, gradient, torch.float32)
            b_loss = _scalar(env_b.get(id(loss)))
            for state in self.states:
                t0 = time.perf_counter()
                a, env_a = self._replay(entries, state.plan, analyse=self.steps == 1)
                out_a = env_a.get(id(tensor))
                grads_a = _grads(out_a, a, gradient, None)
                self._accumulate(state, a, b, grads_a, grads_b)
                state.losses.append(PrecisionLoss(self.steps, _scalar(env_a.get(id(loss))),
                                                  b_loss))
                if state.plan.measured and out_a is not None:
                    same = bool(torch.equal(out_a.detach(), tensor.detach()))
                    state.reproduced = same if state.reproduced is None else (
                        state.reproduced and same)
                state.seconds += time.perf_counter() - t0
        self.kept.append((entries, loss))
        return True

    def _params(self, plan: Plan | None, root: nn.Module,
                state: ModuleState | None = None) -> dict[str, torch.Tensor]:
        """What ``root`` runs with in a replay; buffers as they were when the user's call
        began (``state``), copied: the user's running statistics are never touched."""
        out: dict[str, torch.Tensor] = {}
        rel = _relative(plan.fix, root, self) if plan is not None else []
        for mname, mod in root.named_modules(remove_duplicate=False):
            fixed = any(mname == f or mname.startswith(f + ".") or f == "" for f in rel)
            for pname, p in mod._parameters.items():
                if p is None:
                    continue
                full = f"{mname}.{pname}" if mname else pname
                if plan is None or fixed or not p.is_floating_point():
                    out[full] = p.float() if p.is_floating_point() else p
                elif plan.fp8 is not None:
                    w = p.float()
                    out[full] = round_to(w, plan) if pname == "weight" and is_gemm(mod) else w
                elif plan.param_dtype is not None:
                    out[full] = p.to(plan.param_dtype)
                else:
                    out[full] = p
            for bname, buf in mod._buffers.items():
                if buf is None:
                    continue
                full = f"{mname}.{bname}" if mname else bname
                if state is not None:
                    buf = state.buffers.get(full, buf)
                dt = buf.dtype
                if buf.is_floating_point():
                    if plan is None or fixed or plan.fp8 is not None:
                        dt = torch.float32
                    elif plan.param_dtype is not None:
                        dt = plan.param_dtype
                out[full] = buf.detach().to(dt, copy=True)  # running stats stay the user's
        return out

    def _replay(self, entries: list[Entry], plan: Plan | None, *,
                analyse: bool = False) -> tuple[Measured, dict[int, Any]]:
        roots = [e.fn for e in entries if e.module]
        self.observer.original = {}
        for r in roots:
            for mod in r.modules():
                self.observer.original[id(mod)] = {
                    n: p.detach().float() for n, p in mod._parameters.items()
                    if p is not None and p.is_floating_point()}
        off = {k: (False, d) for k, (_, d) in entries[0].autocast.items()}

        def autocast(e: Entry) -> dict:
            if plan is None or plan.fp8 is not None:
                return off
            if plan.autocast_dtype is not None:
                return dict.fromkeys(e.autocast, (True, plan.autocast_dtype))
            if plan.input_to is not None and plan.param_dtype is None:
                return off
            return e.autocast

        def inputs(t: torch.Tensor) -> torch.Tensor:
            if not t.is_floating_point():
                return t
            if plan is None:
                return t.detach().to(torch.float32, copy=True)
            if plan.input_from is not None and t.dtype == plan.input_from:
                return t.detach().to(plan.input_to, copy=True)
            return t.detach().clone()

        # what the code inside enters (a forward wrapped in autocast) follows the replay too:
        # the float32 reference stays float32, a simulated target computes in the target
        if plan is None or plan.fp8 is not None:
            pinned = autocast_pinned(None)
        elif plan.autocast_dtype is not None:
            pinned = autocast_pinned(plan.autocast_dtype)
        else:
            pinned = contextlib.nullcontext()
        self.observer.begin("float32" if plan is None else "target", plan, analyse=analyse)
        try:
            with pinned, compiled_run_eagerly():
                env = self.tape.replay(entries,
                                       params=lambda e: self._params(plan, e.fn, e.state),
                                       autocast=autocast, inputs=inputs)
        finally:
            seen = self.observer.end()
        return seen, env

    def _accumulate(self, state: _TargetState, a: Measured, b: Measured,
                    grads_a: dict, grads_b: dict) -> None:
        for name, meta in a.meta.items():
            state.meta.setdefault(name, meta)
        for name, data in a.analysis.items():
            state.analysis.setdefault(name, data)
        for key, (sig, noise, bad) in a.local.items():
            s = state.sums[key[0]]
            s.calls += 1
            s.local[0] += sig
            s.local[1] += noise
            s.nonfinite += bad
            for ra, rb in zip(a.outputs.get(key, []), b.outputs.get(key, []), strict=False):
                sg, ns, _ = energies(rb, ra)
                s.e2e[0] += sg
                s.e2e[1] += ns
            for ra, rb in zip(a.inputs.get(key, []), b.inputs.get(key, []), strict=False):
                sg, ns, _ = energies(rb, ra)
                s.e2e_in[0] += sg
                s.e2e_in[1] += ns
            ga, gb = grads_a.get(key), grads_b.get(key)
            if ga and gb:
                for x, y in zip(ga, gb, strict=False):
                    if x is None or y is None:
                        continue
                    sg, ns, _ = energies(y, x)
                    s.grad[0] += sg
                    s.grad[1] += ns
                    s.has_grad = True

    # -- results -------------------------------------------------------------------------

    def fixed_loss_error(self, state: _TargetState,
                         modules: list[str]) -> tuple[float | None, float | None]:
        """Mean relative loss error over the audited batches, without and with ``modules`` in
        float32; every replay uses the current weights, so both sides compare alike."""
        if not self.kept or state.plan is None:
            return None, None
        plan = Plan(**{**state.plan.__dict__, "fix": tuple(modules)})
        before, after = [], []
        roots = _roots([e for entries, _ in self.kept for e in entries])
        with rng_kept(), module_state_kept(roots), torch.no_grad():
            for entries, loss in self.kept:
                ref = _scalar(self._replay(entries, None)[1].get(id(loss)))
                for fixed, out in ((state.plan, before), (plan, after)):
                    got = _scalar(self._replay(entries, fixed)[1].get(id(loss)))
                    err = PrecisionLoss(0, got, ref).error
                    if err is not None:
                        out.append(err)
        return _mean(before), _mean(after)

    def result(self) -> PrecisionAudit | None:
        """The audit of every target (the first one holds the others in ``compare``)."""
        audits = []
        for state in self.states:
            assert state.plan is not None
            fmt = state.plan.fmt
            layers = []
            for name, meta in sorted(state.meta.items(), key=lambda kv: kv[1]["order"]):
                s = state.sums.get(name)
                if s is None:
                    continue
                layers.append(PrecisionLayer(
                    module=name, type=meta["type"], sqnr_db=rank.sqnr_db(*s.local),
                    sqnr_db_end_to_end=rank.sqnr_db(*s.e2e),
                    sqnr_db_end_to_end_in=rank.sqnr_db(*s.e2e_in),
                    drift_jump_db=rank.drift_jump_db(s.e2e_in, s.e2e),
                    drift_added_db=rank.drift_added_db(s.e2e_in, s.e2e),
                    grad_sqnr_db=rank.sqnr_db(*s.grad) if s.has_grad else None,
                    calls=s.calls, order=meta["order"], depth=meta["depth"],
                    leaf=meta["leaf"], dtype=meta.get("dtype", ""), parent=meta.get("parent"),
                    data=state.analysis.get(name, {})))
            audit = PrecisionAudit(
                target=fmt.name, mode="measured" if state.plan.measured else "simulated",
                simulation=state.plan.description, steps=self.steps, layers=layers,
                loss=state.losses[-1] if state.losses else None, loss_by_step=state.losses,
                reproduced=state.reproduced, notes=list(self.notes),
                seconds_audit=(state.seconds / self.steps) if self.steps else None)
            rank.rank_layers(audit, fmt)
            audits.append(audit)
        if not audits:
            return None
        first = audits[0]
        first.compare = audits[1:]
        return first


def _roots(entries: list[Entry]) -> list[nn.Module]:
    out: list[nn.Module] = []
    for e in entries:
        if e.module and all(e.fn is not r for r in out):
            out.append(e.fn)
    return out


def _relative(fix: tuple[str, ...], root: nn.Module, auditor: Auditor) -> list[str]:
    """Fix names (full names) as names relative to ``root``."""
    if not fix:
        return []
    rel = []
    by_name = {n: m for m, n in auditor.names.items()}
    for f in fix:
        target = by_name.get(f)
        if target is None:
            continue
        for qual, mod in root.named_modules():
            if mod is target:
                rel.append(qual)
    return rel


def _grads(out: Any, seen: Measured, gradient: torch.Tensor | None,
           dtype: torch.dtype | None) -> dict:
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        return {}
    keys, inputs, index = [], [], {}
    for key, leaves in seen.outputs.items():
        for t in leaves:
            if t.requires_grad and id(t) not in index:
                index[id(t)] = len(inputs)
                inputs.append(t)
        keys.append(key)
    if not inputs:
        return {}
    g = None if gradient is None else gradient.detach().to(dtype or out.dtype)
    got = torch.autograd.grad(out, inputs, grad_outputs=g, allow_unused=True)
    return {k: [got[index[id(t)]] if id(t) in index else None for t in seen.outputs[k]]
            for k in keys}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _scalar(t: Any) -> float | None:
    if not isinstance(t, torch.Tensor) or t.numel() != 1:
        return None
    return float(t.detach().double().item())


def _device_kind(entries: list[Entry]) -> str:
    for e in entries:
        if e.module:
            p = next(e.fn.parameters(), None)
            if p is not None:
                return p.device.type
    return "cpu"


def raise_bad(message: str) -> None:
    from nanhunt.errors import NanhuntError

    raise NanhuntError(message)
