"""The culprit snapshot: the failing module call copied with its inputs, for the zoom."""

from __future__ import annotations

import copy
import inspect

import torch

from nanhunt import stats as _stats
from nanhunt.capture._util import (
    _MAX_ANCESTOR_COPY,
    _call_leaves,
    _clone_tree,
    _leaves,
    is_library_file,
    map_tensors,
)
from nanhunt.capture.state import Part, Snapshot, _Call, _StepData
from nanhunt.contract import Copies, isolated, nbytes, sharded_how


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
        if f.phase == "communication":
            return  # a reduction across ranks: no module call of this rank to replay
        if f.phase == "data" and f.tensor.startswith("target of "):
            for t in self.cur.targets.values():
                self.bad_samples_of(f.tensor, t)
            return
        # (a collapsing scale fails the same way every step: this step's call will do)
        call = self.culprit_call(f.module, f.step)
        if call is not None and f.phase == "forward":
            self.weights_before(call)
        if call is None or call.args is None:
            return
        stale = list(call.mutated_inputs)
        for path, t in _call_leaves(call.args, call.kwargs):
            idx = self.cur.lookup(t)
            if idx is None and _stats.summarizable(t) and id(t) in self.cur.seen:
                stale.append(path)
        sharded = sharded_how(call.module)
        if sharded:  # its forward gathers weights with collectives: no rank replays it alone
            self.s.failure_extra["snapshot_error"] = (
                f"{call.name} is {sharded}: one rank cannot replay it alone")
            return
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

    @torch.no_grad()
    def weights_before(self, call: _Call) -> None:
        """A forward failure whose module read non-finite weights did not start in this call:
        the weights were made non-finite before it, where nanhunt did not look (a hand-written
        update, a load, an edit of ``.data``; an optimizer step nanhunt observes is located at
        that step instead). The failure says so and names no cause (checked at a failure
        only: one pass over the culprit's own parameters)."""
        f = self.judge.first_failure
        bad = [f"{call.name}.{n}" for n, p in call.module.named_parameters()
               if _stats.summarizable(p) and not bool(torch.isfinite(p).all())]
        if f is None or not bad:
            return
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        f.observed = False
        f.detail = (f"{call.name} read parameters that were already non-finite "
                    f"({', '.join(bad[:3])}{more}): they were made so before this call, by code "
                    "nanhunt does not observe (a hand-written optimizer step, a load, an edit "
                    "of .data) or in a step it did not trace (check the code that updates or "
                    "loads them; with a torch optimizer nanhunt sees the update itself)")

    def culprit_call(self, module: str, step: int) -> _Call | None:
        """The culprit's call in this step: the one the judge located when it was this step
        (a module called twice, with and without gradients), else its last call."""
        cid = self.judge.origin_call
        if step == self.s._step and cid is not None and cid < len(self.cur.calls) \
                and self.cur.calls[cid].name == module:
            return self.cur.calls[cid]
        return next((c for c in reversed(self.cur.calls) if c.name == module), None)

    def probe_unscaled(self, d: _StepData, call_id: int | None, module: str) -> str | None:
        """Whether the gradient a module call's backward made non-finite in a step GradScaler
        skipped stays non-finite without the loss scale: its call is replayed, on copies and
        with nanhunt's hooks off, backward from the gradients it received divided by the scale.
        A text saying so when it does (no scale would have avoided it: an op at a special
        point, or gradients too large for the format unscaled); None when the unscaled replay
        is finite (GradScaler's overflow on purpose) or the call cannot be replayed."""
        scale = d.scale
        if call_id is not None and call_id < len(self.cur.calls):
            call: _Call | None = self.cur.calls[call_id]
        else:  # its last call that received gradients
            call = next((c for c in reversed(self.cur.calls) if c.name == module
                         and any(self.cur.grads.get(i) is not None for i in c.output_rows)),
                        None)
        if not scale or call is None or call.args is None \
                or sum(p.numel() for p in call.module.parameters()) > _MAX_ANCESTOR_COPY:
            return None
        grads = [self.cur.grads.get(i) for i in call.output_rows]
        if not any(g is not None for g in grads) or any(
                g is not None and not bool(torch.isfinite(g).all()) for g in grads):
            return None  # it received a non-finite gradient: not its own doing
        was_active, self.s._active = self.s._active, False
        try:  # under the replay contract: every generator and mode put back, copies declared
            with isolated(neutral=False):
                finite = self._replay_backward(call, [None if g is None else g / scale
                                                      for g in grads])
        except Exception:  # the call cannot be replayed alone (or its copy is refused)
            return None
        finally:
            self.s._active = was_active
        if finite is None or finite:
            return None
        return (f"replayed alone with its gradient unscaled (divided by the loss scale "
                f"{scale:g}), {call.name}'s backward still made non-finite values: no loss scale "
                "avoids them")

    @staticmethod
    def _replay_backward(call: _Call, grad_outputs: list) -> bool | None:
        # (not nanhunt.replay.module.replay: the replay builds on capture, and this runs
        # inside the session, on the live call, needing only whether the result is finite; it
        # keeps the same contract, nanhunt.contract, on copies declared against its cap)
        copies = Copies()
        module = copies.module(call.module, f"{call.name} (GradScaler's unscaled probe)")
        for p in module.parameters():
            p.grad = None

        def leaf(t: torch.Tensor) -> torch.Tensor:
            t = t.detach().clone()
            return t.requires_grad_(t.is_floating_point())

        copies.declare("its inputs", nbytes(call.args, call.kwargs))
        args = map_tensors(call.args, leaf)
        kwargs = _clone_tree(call.kwargs or {})
        enabled, dtype = call.autocast
        device = next((t.device.type for _, t in _leaves(args, "")), "cpu")
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=bool(enabled)):
            out = module(*args, **kwargs)
        outs = [t for _, t in _leaves(out, "") if _stats.summarizable(t)]
        pairs = [(o, g.to(o.dtype)) for o, g in zip(outs, grad_outputs)
                 if g is not None and o.requires_grad and o.shape == g.shape]
        if not pairs:
            return None
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [t.grad for _, t in _leaves(args, "") if t.grad is not None]
        grads += [p.grad for p in module.parameters() if p.grad is not None]
        return all(bool(torch.isfinite(g).all()) for g in grads)

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
        """The user's line that makes the culprit's call (file, line, text): in the forward of
        the nearest enclosing module whose code is the user's (torch's TransformerEncoderLayer
        is not), the line that calls the child leading to the culprit; with none, the line
        that called the model."""
        child = call
        while child.parent is not None:
            up = self.cur.calls[child.parent]
            found = _line_calling(up, child)
            if found is not None:
                return found
            child = up
        return child.site

    def bad_samples(self, call: _Call) -> None:
        for path, t in _call_leaves(call.args, call.kwargs):
            self.bad_samples_of(path, t)

    def bad_samples_of(self, path: str, t: torch.Tensor) -> None:
        if _stats.summarizable(t) and t.dim() >= 1 and t.numel():
            bad = ~torch.isfinite(t.detach()).reshape(t.shape[0], -1).all(dim=1)
            idx = torch.nonzero(bad).flatten().tolist()
            if idx:
                self.s.failure_extra.setdefault("bad_samples", {})[path] = idx[:100]
                extra = self.s.failure_extra
                extra["batch_rows"] = max(extra.get("batch_rows", 0), int(t.shape[0]))


def _line_calling(parent: _Call, child: _Call) -> tuple[str, int, str] | None:
    """The line of ``parent``'s forward that calls ``child`` (its attribute, or the
    container holding it: ``self.layers`` for ``layers.3``), when that forward is user code."""
    try:
        fname = inspect.getsourcefile(type(parent.module).forward) or ""
        lines, start = inspect.getsourcelines(type(parent.module).forward)
    except (OSError, TypeError):
        return None
    if not fname or is_library_file(fname):
        return None
    rel = child.name[len(parent.name) + 1:] if parent.name and child.name.startswith(
        parent.name + ".") else child.name
    attr = rel.split(".")[0]
    for needle in (f"self.{attr}(", f"self.{attr}"):  # the call first, else any mention
        for i, line in enumerate(lines):
            if needle in line:
                return fname, start + i, line.strip()
    return None
