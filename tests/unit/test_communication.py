"""The communication phase, in process: DDP over a one-rank gloo group (a FileStore in a temp
folder), where a compression hook still casts each gradient bucket before the all-reduce.

A float16 compression of gradients above 65504 makes them inf in the reduction; nanhunt must
find that in the phase ``communication``, with this rank's own finite gradient as evidence and
the hook named, and offer comm-hook:bf16 / comm-hook:none, whose installed fixes must train
exactly as the snippet's change does. The bf16 and no-hook twins stay quiet.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import nanhunt
from nanhunt.analyse.advise import advise
from nanhunt.analyse.remedies import context
from nanhunt.experiment.fixes import FixMismatch, install
from nanhunt.fixspec import parse_fix, snippet

HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook,
         "none": None}
BIG_STEP = 2


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 4, generator=g) * (300.0 if step == BIG_STEP else 1.0)


def _train(hook: str, steps: int = 4, watch: bool = False, fixes: list[str] = ()):
    """Losses and final weights of the script's loop; a ``--fix`` installed around it."""
    installed = install([parse_fix(f) for f in fixes]) if fixes else None
    try:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
        if HOOKS[hook] is not None:
            model.register_comm_hook(None, HOOKS[hook])
        opt = torch.optim.SGD(model.parameters(), lr=1e-9)
        losses, hunt = [], None

        def loop():
            for step in range(steps):
                loss = model(_batch(step)).pow(2).mean() * (1e3 if step == BIG_STEP else 1.0)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())

        if watch:
            with nanhunt.watch(model, opt) as hunt:
                loop()
        else:
            loop()
        weights = [p.detach().clone() for p in model.parameters()]
    finally:
        message = installed.uninstall() if installed is not None else None
    return losses, weights, hunt, message


@pytest.fixture(scope="module")
def fp16_run():
    losses, weights, hunt, _ = _train("fp16", watch=True)
    trace = hunt.trace()
    advise(trace)
    return losses, weights, trace


def test_a_compressed_reduction_that_overflows_is_found_in_the_communication_phase(fp16_run):
    _losses, _weights, trace = fp16_run
    f = trace.first_failure
    assert (f.step, f.phase, f.module, f.tensor) == (BIG_STEP, "communication", "0",
                                                     "0.weight.grad")
    assert f.stats.posinf + f.stats.neginf > 0
    assert f.reduction == "DDP all-reduce through fp16_compress_hook"
    assert f.reduce_dtype == "float16"
    assert trace.run.comm_hooks == ["fp16_compress_hook"]
    # this rank's own gradient, against an independent float32 backward of the same weights
    before = _train("fp16", steps=BIG_STEP)[1]  # the weights step 2 used
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        for p, w in zip(plain.parameters(), before):
            p.copy_(w)
    (plain(_batch(BIG_STEP)).pow(2).mean() * 1e3).backward()
    expected = plain[0].weight.grad.abs().max().item()
    assert f.local_grad is not None and f.local_grad.nonfinite == 0
    assert f.local_grad.amax == pytest.approx(expected, rel=1e-6)
    assert expected > torch.finfo(torch.float16).max


def test_the_diagnosis_names_the_hook_and_offers_installable_fixes(fp16_run):
    _losses, _weights, trace = fp16_run
    d = trace.diagnosis
    assert (d.rule, d.kind, d.phase) == ("reduction-overflow", "overflow", "communication")
    assert "fp16_compress_hook" in d.message and "float16" in d.message
    fixes = {r.type: r.fix for r in trace.recommendations}
    assert fixes["no_comm_hook"] == ["comm-hook:none"]
    # DDP accepts bf16_compress_hook only with CUDA and NCCL (or XPU): not offered on the CPU
    assert "comm_hook" not in fixes
    off = next(r for r in trace.recommendations if r.type == "no_comm_hook")
    assert any("bf16_compress_hook" in e and "this run is on cpu" in e for e in off.evidence)
    trace.run.device = "cuda:0"
    advise(trace)
    fixes = {r.type: r.fix for r in trace.recommendations}
    assert fixes["comm_hook"] == ["comm-hook:bf16"]
    hook = next(r for r in trace.recommendations if r.type == "comm_hook")
    assert "default_hooks.bf16_compress_hook" in hook.snippet
    trace.run.device = "cpu"
    advise(trace)


def test_nanhunt_leaves_the_losses_and_weights_alone(fp16_run):
    losses, weights, _trace = fp16_run
    plain_losses, plain_weights, _, _ = _train("fp16")
    assert losses == plain_losses or all(
        a == b or (a != a and b != b) for a, b in zip(losses, plain_losses))
    for a, b in zip(weights, plain_weights):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_the_healthy_twin_stays_quiet_with_the_phase_observed():
    """No hook: the same loop, the same big step, reduced in float32."""
    losses, _weights, hunt, _ = _train("none", watch=True)
    trace = hunt.trace()
    assert trace.first_failure is None and not trace.problem
    assert all(abs(x) < float("inf") for x in losses)
    assert trace.run.comm_hooks == []
    rows = [m for d in hunt.recorder.ring for m in d.metas if m.phase == "communication"]
    assert {m.tensor for m in rows} == {"0.weight.grad", "0.bias.grad", "2.weight.grad",
                                        "2.bias.grad"}


def test_an_installed_fix_trains_as_its_snippet_does():
    """comm-hook:none installed from outside the fp16 script, against the script edited as the
    snippet says (no hook registered): the same losses and weights, bit for bit."""
    code = snippet([parse_fix("comm-hook:none")], context(nanhunt.trace.Trace())).code
    assert code.startswith("# no model.register_comm_hook(")
    fixed_losses, fixed_weights, _, message = _train("fp16", fixes=["comm-hook:none"])
    twin_losses, twin_weights, _, _ = _train("none")
    assert message is None
    assert fixed_losses == twin_losses
    assert all(torch.equal(a, b) for a, b in zip(fixed_weights, twin_weights))
    assert all(abs(x) < float("inf") for x in fixed_losses)


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build accepts the bf16 hook")
def test_comm_hook_bf16_where_ddp_refuses_it_is_one_clear_line():
    with pytest.raises(FixMismatch, match=r"^--fix comm-hook:bf16: BF16 all reduce .*"
                                          "use comm-hook:none$"):
        _train("fp16", steps=1, fixes=["comm-hook:bf16"])


def test_a_comm_hook_fix_for_a_script_without_a_hook_says_so():
    _losses, _weights, _, message = _train("none", steps=1, fixes=["comm-hook:bf16"])
    assert message == ("--fix comm-hook:bf16: the script registered no DDP communication hook "
                       "(register_comm_hook)")


def test_no_sync_backwards_reduce_nothing_and_record_no_reduction():
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt) as hunt:
        for _ in range(2):
            with model.no_sync():
                model(torch.randn(2, 4)).sum().backward()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    rows = [(d.index, m.phase, m.tensor) for d in hunt.recorder.ring for m in d.metas
            if m.role == "reduced_grad"]
    # one synchronised backward a step, two parameters each; none for the no_sync backwards
    assert sorted(rows) == [(s, "communication", t) for s in (0, 1)
                            for t in ("bias.grad", "weight.grad")]
