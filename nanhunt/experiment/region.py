"""The region rung: bisect float32 over the module tree to the smallest region that removes the
failure. Torch-free: it plans ``--fix fp32:...`` re-runs and reads their outcomes.

It runs only where float32 everywhere removed the failure (a precision failure: there is no
point bisecting a learning-rate problem). The tree is the report's modules (``trace.layers``):
a module's children are the modules whose nearest recorded ancestor it is, in the order they
ran. From the model's children down:

* split the current modules in two halves (in execution order) and re-run each half in float32
  (``fp32:a,b..`` under autocast: the outputs stay float32 on to what follows, which autocast
  casts down where it computes in half precision; ``fp32:a,b``, each output cast back, for a
  model cast to half precision), the two at once where ``--jobs`` allows;
* a half that trains is the new region: split it again; a single module is opened up into its
  children (the region it names is known to train, so that costs no re-run);
* where no half trains but one moved the failure (to another step or place: fixing the first
  instance lets the next one fail), its modules' siblings are tried together (``blocks.1`` ->
  ``blocks.*``); that region, when it trains, is bisected the same way;
* where nothing trains, the search stops: the region is the last one that trained. At the top,
  the whole module tree is tried once; if it fails too, no module region removes the failure
  (float32 everywhere also turns GradScaler off and covers code outside the modules).

Before the bisection, the module where the first non-finite value was observed (the locator's
fact, not a rule's reading) is tried alone: where it is the region, one re-run finds it (a
container that trains is then bisected inside; a move tries its siblings; a failure starts the
bisection from the top). Each level costs two re-runs (one when the first half trains and
``--jobs`` is 1), so the search is about 2 log2(modules) re-runs deep, capped at
:data:`MAX_RUNS`.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from nanhunt.analyse.diagnose import is_loss_type, module_pattern
from nanhunt.trace import Trace

__all__ = ["MAX_RUNS", "Bisection", "Tree", "spec"]

#: at most this many re-runs for the bisection (the --budget may stop it sooner)
MAX_RUNS = 16


def spec(patterns: list[str], keep: bool = False) -> str:
    """The ``--fix`` spec that runs ``patterns`` in float32: each output cast back, or with
    ``keep`` left in float32 (``fp32:a,b..``), on to what follows."""
    return "fp32:" + ",".join(patterns) + (".." if keep else "")


class Tree:
    """The module tree of a report: qualified names, parents and execution order."""

    def __init__(self, trace: Trace) -> None:
        names = [layer.module for layer in trace.layers if layer.module]
        types = {layer.module: layer.type for layer in trace.layers}
        self.names = list(dict.fromkeys(names))
        known = set(self.names)
        # a container's call ends after its children's: the first end among a module and its
        # descendants is its place in execution order
        order: dict[str, int] = {}
        for i, n in enumerate(self.names):
            parts = n.split(".")
            for k in range(1, len(parts) + 1):
                order.setdefault(".".join(parts[:k]), i)
        self.order = order
        self.parent: dict[str, str | None] = {}
        for n in self.names:
            parts = n.split(".")
            self.parent[n] = next((".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)
                                   if ".".join(parts[:k]) in known), None)
        # the model's root is named by its variable and holds the modules named without it;
        # it is no unit of the search (float32 for all of it is tried as "the whole tree")
        tops = [n for n in self.names if self.parent[n] is None]
        # the root: the last top-level module to end that is no loss and has no module named
        # under it (its children are named without it), after another top-level module
        above = {".".join(n.split(".")[:k]) for n in self.names for k in range(1, n.count(".") + 1)}
        # (named by its variable: no dot; a step that failed before its containers returned
        # recorded none, and then there is no root)
        plain = [n for n in tops if not is_loss_type(types.get(n, "")) and n not in above
                 and "." not in n]
        self.roots = {plain[-1]} if len(plain) > 1 else set()
        self.top = sorted((n for n in tops if n not in self.roots), key=self._key)

    def _key(self, name: str) -> int:
        return self.order.get(name, len(self.names))

    def matches(self, patterns: list[str]) -> int:
        """How many modules ``patterns`` name."""
        return sum(any(fnmatch.fnmatchcase(n, p) for p in patterns) for n in self.names)

    def children(self, pattern: str) -> list[str]:
        """The children of the modules ``pattern`` names, as patterns under it, in execution
        order (``blocks.*`` -> ``blocks.*.attn``, ``blocks.*.ffn``)."""
        out: dict[str, int] = {}
        depth = pattern.count(".") + 1
        for n in self.names:
            p = self.parent.get(n)
            if p is None or not fnmatch.fnmatchcase(p, pattern):
                continue
            if p.count(".") + 1 != depth:
                continue
            child = pattern + n[len(p):]
            out.setdefault(child, self._key(n))
        return sorted(out, key=out.__getitem__)


@dataclass
class Step:
    """One re-run of the search: the region tried, and what it did."""

    patterns: list[str]
    why: str  # "half", "siblings", "whole tree"
    outcome: str = "not run"


@dataclass
class Bisection:
    """The search's state. :meth:`propose` gives the regions to re-run now, :meth:`record` their
    outcomes (``Experiment.outcome`` words); :attr:`region` is the smallest that trained."""

    tree: Tree
    #: the regions keep their outputs in float32 (under autocast, whose own op lists cast them
    #: down where it runs half precision): a float32 output above float16's max that is cast
    #: back is inf again (DESIGN.md §4); a model cast with .half() gets its outputs cast back
    keep: bool = False
    units: list[str] = field(default_factory=list)
    region: list[str] | None = None  # the smallest region known to train
    steps: list[Step] = field(default_factory=list)
    done: bool = False
    stopped: str = ""  # why the search ended early (the cap, the budget)
    started: bool = True  # the bisection from the top has begun (not while probing the origin)
    _pending: list[Step] = field(default_factory=list)

    @classmethod
    def of(cls, trace: Trace) -> Bisection:
        tree = Tree(trace)
        b = cls(tree, keep=bool(trace.run.autocast), units=list(tree.top))
        origin = trace.first_failure.module if trace.first_failure is not None else ""
        if not b.units:
            b.done = True
        elif origin and origin in tree.names:
            # the module where the first non-finite value was observed (the locator's fact, no
            # rule's reading) is tried alone first: where it is the region, one re-run finds it
            b.started = False
            b._pending = [Step([origin], "origin")]
        else:
            b._start()
        return b

    def _start(self) -> None:
        """Begin the bisection from the model's children."""
        self.started = True
        self.units = list(self.tree.top)
        if len(self.units) == 1:
            self._pending = [Step(list(self.units), "whole tree")]

    @property
    def runs(self) -> int:
        return len([s for s in self.steps if s.outcome != "not run"])

    def specs(self) -> list[str]:
        """:meth:`propose` as ``--fix`` specs."""
        return [spec(p, self.keep) for p in self.propose()]

    def propose(self) -> list[list[str]]:
        """The regions to try now, first the likelier (the first half); [] when done."""
        while True:
            if self.done:
                return []
            if self.runs >= MAX_RUNS:
                self.done, self.stopped = True, f"stopped at {MAX_RUNS} re-runs"
                return []
            if not self._pending:
                n = len(self.units) // 2
                self._pending = [Step(self.units[:n], "half"), Step(self.units[n:], "half")]
            # a region tried already (the origin alone, then a half that is the origin) is not
            # re-run: its outcome stands
            known = {spec(s.patterns, self.keep): s.outcome for s in self.steps
                     if s.outcome not in ("not run", "skipped")}
            fresh = []
            for s in self._pending:
                if spec(s.patterns, self.keep) in known:
                    s.outcome = known[spec(s.patterns, self.keep)]
                else:
                    fresh.append(s)
            if fresh:
                return [s.patterns for s in fresh]
            self.record({})  # every region of this level ran already: go on from them

    def record(self, outcomes: dict[str, str]) -> None:
        """Outcomes by spec (:func:`spec`); a region with none did not run (the budget)."""
        tried = self._pending
        self._pending = []
        ran = {spec(s.patterns, self.keep) for s in self.steps}
        for s in tried:  # (a region that ran at an earlier level keeps its outcome)
            s.outcome = outcomes.get(spec(s.patterns, self.keep), s.outcome)
        tried = [s for s in tried if s.outcome != "skipped"]  # not needed: the other trained
        self.steps += [s for s in tried if spec(s.patterns, self.keep) not in ran]
        won = next((s for s in tried if s.outcome == "trained"), None)
        if won is not None:
            self.region = won.patterns
            if won.why == "whole tree" and any(s.why == "half" for s in self.steps):
                self.done = True  # its halves failed already: nothing narrower at this level
                return
            if won.patterns[0] in self.tree.roots:  # the model itself: bisect its children
                self.started, self.units = True, list(self.tree.top)
                if len(self.units) == 1:
                    self._narrow(self.units)
                return
            self._narrow(won.patterns)
            return
        if any(s.outcome == "not run" for s in tried):
            self.done, self.stopped = True, "the --budget was spent"
            return
        why = tried[0].why if tried else ""
        moved = next((s for s in tried if s.outcome == "moved"), None)
        if moved is not None and why in ("half", "origin"):
            siblings = list(dict.fromkeys(module_pattern(p) for p in moved.patterns))
            if self.tree.matches(siblings) > self.tree.matches(moved.patterns) and \
                    not self._covers(siblings):
                self._pending = [Step(siblings, "siblings")]
                return
        if not self.started:  # the origin (and its siblings) alone is not enough
            self._start()
            return
        if self.region is None and why == "half" and len(self.units) > 1 and \
                not any(s.why == "whole tree" for s in self.steps):
            self._pending = [Step(list(self.units), "whole tree")]
            return
        self.done = True

    def _covers(self, patterns: list[str]) -> bool:
        """Whether the region known to train is these patterns already."""
        return self.region is not None and sorted(self.region) == sorted(patterns)

    def _narrow(self, patterns: list[str]) -> None:
        """Continue inside a region that trained: split it, or open up a single module."""
        units = list(patterns)
        while len(units) == 1:
            kids = self.tree.children(units[0])
            if not kids:
                self.done = True
                return
            units = kids
        self.units = units

    def text(self) -> str:
        """What the search did, in one line (for the report when it found no region)."""
        if self.region is not None:
            return f"the bisection found `{','.join(self.region)}` in {self.runs} re-runs"
        if not self.steps:
            return "no module region was tried"
        if self.stopped:
            return f"no module region removed it before the search {self.stopped}"
        return (f"no module region alone removes it ({self.runs} re-runs of the bisection; "
                "float32 everywhere also disables GradScaler and covers code outside the "
                "modules)")
