"""The culprit snapshot: the failing module call copied with its inputs, for the zoom."""

from __future__ import annotations

import copy
import inspect

import torch

from .. import stats as _stats
from ._util import _MAX_ANCESTOR_COPY, _call_leaves, _clone_tree
from .state import Part, Snapshot, _Call, _StepData


class Snapshots(Part):
    """Copies the culprit module and its captured inputs the moment the judge finds the first
    failure (while the step's tensors are still unchanged), with its enclosing calls and, for
    bad data, which samples of the batch were non-finite."""

    def take(self, d: _StepData, origin_step: _StepData) -> None:
        """Copy the culprit module and its captured inputs, while they are still unchanged."""
        f = self.judge.first_failure
        if f is None or not self.s.keep_tensors:
            return
        if f.step != self.s._step and self.judge.problem != "collapse":
            return  # the failing step's inputs are gone
        if f.phase == "data" and f.tensor.startswith("target of "):
            for t in self.cur.targets.values():
                self.bad_samples_of(f.tensor, t)
            return
        # (a collapsing scale fails the same way every step: this step's call will do)
        call = next((c for c in reversed(self.cur.calls) if c.name == f.module), None)
        if call is None or call.args is None:
            return
        stale = list(call.mutated_inputs)
        for path, t in _call_leaves(call.args, call.kwargs):
            idx = self.cur.lookup(t)
            if idx is None and _stats.summarizable(t) and id(t) in self.cur.seen:
                stale.append(path)
        try:
            module = copy.deepcopy(call.module)
            args = _clone_tree(call.args)
            kwargs = _clone_tree(call.kwargs)
        except Exception as exc:  # a module that cannot be copied is replayed by nobody
            self.s.failure_extra["snapshot_error"] = f"{type(exc).__name__}: {exc}"
            return
        grads = None
        if f.phase in ("backward", "loss_scaling"):
            grads = [self.cur.grads.get(i) for i in call.output_rows]
            grads = [g.detach().clone() if g is not None else None for g in grads]
        self.s.snapshot = Snapshot(module=module, name=call.name, args=args, kwargs=kwargs,
                                   grad_outputs=grads, autocast=call.autocast, phase=f.phase,
                                   step=self.s._step, stale_inputs=stale,
                                   call_site=self.call_site(call))
        if f.phase == "data":
            self.bad_samples(call)
        else:
            self.s.snapshot.ancestors = self.ancestor_snapshots(call)

    def ancestor_snapshots(self, call: _Call) -> list[Snapshot]:
        out: list[Snapshot] = []
        parent = call.parent
        while parent is not None:
            c = self.cur.calls[parent]
            params = sum(p.numel() for p in c.module.parameters())
            if c.args is None or params > _MAX_ANCESTOR_COPY:
                break
            try:
                module = copy.deepcopy(c.module)
                args, kwargs = _clone_tree(c.args), _clone_tree(c.kwargs)
            except Exception:
                break
            names = {rel: self.s.naming.names.get(m) or (f"{c.name}.{rel}" if rel else c.name)
                     for rel, m in c.module.named_modules()}
            out.append(Snapshot(module=module, name=c.name, args=args, kwargs=kwargs,
                                grad_outputs=None, autocast=c.autocast, phase="forward",
                                step=self.s._step, names=names))
            parent = c.parent
        return out

    def call_site(self, call: _Call) -> tuple[str, int, str] | None:
        """The line in the parent's forward that calls the culprit (file, line, text)."""
        if call.parent is None:
            return None
        parent = self.cur.calls[call.parent].module
        attr = call.name.rsplit(".", 1)[-1]
        parts = call.name.split(".")
        if attr.isdigit() and len(parts) >= 2:  # a ModuleList / Sequential element
            attr = parts[-2]
        try:
            lines, start = inspect.getsourcelines(type(parent).forward)
            fname = inspect.getsourcefile(type(parent).forward) or ""
        except (OSError, TypeError):
            return None
        for i, line in enumerate(lines):
            if f"self.{attr}" in line:
                return fname, start + i, line.strip()
        return None

    def bad_samples(self, call: _Call) -> None:
        for path, t in _call_leaves(call.args, call.kwargs):
            self.bad_samples_of(path, t)

    def bad_samples_of(self, path: str, t: torch.Tensor) -> None:
        if _stats.summarizable(t) and t.dim() >= 1 and t.numel():
            bad = ~torch.isfinite(t.detach()).reshape(t.shape[0], -1).all(dim=1)
            idx = torch.nonzero(bad).flatten().tolist()
            if idx:
                self.s.failure_extra.setdefault("bad_samples", {})[path] = idx[:100]
