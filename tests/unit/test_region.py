"""The region rung's bisection (nanhunt.experiment.region) on hand-built module trees, against
an oracle that knows which modules must run in float32: the smallest region, in about
2 log2(modules) re-runs, siblings together where one fixed instance moves the failure, and the
search stopping honestly where no module region is enough. Torch-free."""

from __future__ import annotations

import fnmatch
import math

from nanhunt.experiment.region import MAX_RUNS, Bisection, Tree, spec
from nanhunt.trace import LayerStats, RunInfo, Trace


def _trace(names: list[str], *, autocast: bool = True, losses: tuple[str, ...] = ()) -> Trace:
    """A report's modules in the order their calls ended (children before their container)."""
    t = Trace(run=RunInfo(target="float16", autocast=autocast))
    t.layers = [LayerStats(module=n, type="Loss" if n in losses else "Linear") for n in names]
    return t


def _transformer(blocks: int) -> list[str]:
    names = ["embed"]
    for b in range(blocks):
        p = f"blocks.{b}"
        names += [f"{p}.attn.qkv", f"{p}.attn.proj", f"{p}.attn", f"{p}.ffn.wi", f"{p}.ffn.act",
                  f"{p}.ffn.wo", f"{p}.ffn", f"{p}.norm", p]
    return [*names, "norm", "head", "model", "criterion"]


def _covered(module: str, patterns: list[str]) -> bool:
    parts = module.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:k]), p) for p in patterns
               for k in range(1, len(parts) + 1))


def _search(b: Bisection, oracle) -> list[list[str]]:
    tried = []
    while True:
        proposals = b.propose()
        if not proposals:
            return tried
        assert not any(p in tried for p in proposals), (proposals, tried)  # never twice
        tried += proposals
        b.record({spec(p, b.keep): oracle(p) for p in proposals})


def test_the_tree_in_execution_order():
    tree = Tree(_trace(_transformer(2), losses=("criterion",)))
    assert tree.top == ["embed", "blocks.0", "blocks.1", "norm", "head", "criterion"]
    assert tree.roots == {"model"}
    assert tree.children("blocks.1") == ["blocks.1.attn", "blocks.1.ffn", "blocks.1.norm"]
    assert tree.children("blocks.*.ffn") == ["blocks.*.ffn.wi", "blocks.*.ffn.act",
                                             "blocks.*.ffn.wo"]
    assert tree.children("head") == []


def test_one_culprit_is_found_in_log2_levels():
    names = _transformer(8)
    culprit = "blocks.5.ffn.wo"
    b = Bisection.of(_trace(names, losses=("criterion",)))
    tried = _search(b, lambda p: "trained" if _covered(culprit, p) else "recurred")
    assert b.region == [culprit] and b.done
    assert spec(b.region, b.keep) == "fp32:blocks.5.ffn.wo.."
    modules = len([n for n in names if n not in ("model",)])
    # two re-runs a level; a level halves the modules or opens one up
    assert len(tried) <= 2 * (math.ceil(math.log2(modules)) + 3), tried
    assert len(tried) < modules


def test_a_model_cast_to_half_gets_its_outputs_cast_back():
    b = Bisection.of(_trace(_transformer(1), autocast=False))
    assert not b.keep and spec(["blocks.0"], b.keep) == "fp32:blocks.0"


def test_siblings_are_tried_together_where_one_fixed_moves_the_failure():
    # blocks.1.ffn overflows first; once it is in float32, blocks.0.ffn does (T5-style)
    names = _transformer(2)

    def oracle(p):
        one, zero = _covered("blocks.1.ffn.wo", p), _covered("blocks.0.ffn.wo", p)
        return "trained" if one and zero else "moved" if one else "recurred"

    b = Bisection.of(_trace(names))
    tried = _search(b, oracle)
    assert ["blocks.*"] in tried  # blocks.1 alone moved the failure: its siblings together
    assert b.region == ["blocks.*.ffn.wo"], tried


def test_no_module_region_is_said_so_after_the_whole_tree():
    b = Bisection.of(_trace(_transformer(2), losses=("criterion",)))
    tried = _search(b, lambda p: "recurred")
    # the whole tree once, the loss module with it
    assert tried[-1] == ["embed", "blocks.0", "blocks.1", "norm", "head", "criterion"]
    assert b.region is None and "no module region alone removes it" in b.text()


def test_the_region_needs_both_halves():
    # the failure goes only when embed and head are both float32: the region stays the whole
    # set it last knew to train
    b = Bisection.of(_trace(["embed", "mid", "head", "model"]))
    tried = _search(b, lambda p: "trained" if _covered("embed", p) and _covered("head", p)
                    else "recurred")
    assert b.region == ["embed", "mid", "head"], tried


def test_a_spent_budget_stops_the_search_and_keeps_what_it_found():
    b = Bisection.of(_trace(_transformer(4)[:-1]))
    b.record({spec(p, b.keep): "trained" if "blocks.3" in p else "recurred"
              for p in b.propose()})
    assert b.region == ["blocks.2", "blocks.3", "norm", "head"]
    b.propose()
    b.record({})  # nothing ran: the budget
    assert b.done and b.region == ["blocks.2", "blocks.3", "norm", "head"]
    assert b.stopped == "the --budget was spent"


def test_the_search_is_capped():
    names = [f"layers.{i}" for i in range(1024)] + ["model"]  # 10 levels: 20 re-runs uncapped
    b = Bisection.of(_trace(names))
    _search(b, lambda p: "trained" if "layers.1023" in p else "recurred")
    assert b.runs <= MAX_RUNS


def _with_origin(names: list[str], origin: str) -> Trace:
    from nanhunt.trace import Failure, TensorStats

    t = _trace(names, losses=("criterion",))
    t.first_failure = Failure(step=3, phase="forward", module=origin, tensor="output",
                              stats=TensorStats(dtype="float16", shape=[4], numel=4, posinf=1))
    return t


def test_the_module_where_the_failure_was_seen_is_tried_alone_first():
    culprit = "blocks.5.ffn.wo"
    b = Bisection.of(_with_origin(_transformer(8), culprit))
    tried = _search(b, lambda p: "trained" if _covered(culprit, p) else "recurred")
    assert tried == [[culprit]] and b.region == [culprit]


def test_an_origin_that_moves_the_failure_tries_its_siblings_then_the_bisection():
    def oracle(p):
        one, zero = _covered("blocks.1.ffn.wo", p), _covered("blocks.0.ffn.wo", p)
        return "trained" if one and zero else "moved" if one else "recurred"

    b = Bisection.of(_with_origin(_transformer(2), "blocks.1.ffn.wo"))
    tried = _search(b, oracle)
    assert tried[:2] == [["blocks.1.ffn.wo"], ["blocks.*.ffn.wo"]]
    assert b.region == ["blocks.*.ffn.wo"] and len(tried) == 2


def test_an_origin_that_is_not_the_cause_falls_back_to_the_bisection():
    # the NaN is seen in the head, made upstream in blocks.1's attention
    culprit = "blocks.1.attn.qkv"
    b = Bisection.of(_with_origin(_transformer(4), "head"))
    tried = _search(b, lambda p: "trained" if _covered(culprit, p) else "recurred")
    assert tried[0] == ["head"] and b.region == [culprit]


def test_an_op_in_the_models_own_forward_keeps_the_model():
    # q @ k^T in the root's forward: only the model as a whole in float32 trains
    names = ["q", "k", "head", "model", "criterion"]
    b = Bisection.of(_with_origin(names, "model"))
    tried = _search(b, lambda p: "trained" if "model" in p else "recurred")
    assert tried[0] == ["model"] and b.region == ["model"]
    assert "model" not in b.tree.top  # its children are bisected, none trains alone


def test_a_half_that_is_the_origin_alone_is_not_run_again():
    """Three modules, the failure seen in the first: the origin alone recurs, and the first half
    of the bisection is that same module; its outcome stands (no second re-run of it) and the
    search goes on with the other half."""
    b = Bisection.of(_with_origin(["0", "1", "2", "model"], "0"))
    tried = _search(b, lambda p: "recurred")  # (_search asserts that nothing is tried twice)
    assert tried[0] == ["0"]
    assert ["0"] not in tried[1:] and ["1", "2"] in tried
    assert b.region is None and b.runs == len(tried)
