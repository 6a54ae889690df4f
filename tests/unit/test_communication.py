"""The communication phase, in process: DDP over a one-rank gloo group (a FileStore in a temp
folder), where a compression hook still casts each gradient bucket before the all-reduce.

A float16 compression of gradients above 65504 makes them inf in the reduction; nanhunt must
find that in the phase ``communication``, with this rank's own finite gradient as evidence and
the hook named, and offer comm-hook:bf16 / comm-hook:none, whose installed fixes must train
exactly as the snippet's change does. The bf16 and no-hook twins stay quiet.
"""

from __future__ import annotations

import json

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


# ----------------------------------------------------------------------------- FSDP2


class _Boost(nn.Module):
    def forward(self, x):
        return x * 1.0


def _fsdp_model(dtype, snippet_code: str | None = None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), _Boost(), nn.Linear(16, 4))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if snippet_code is not None:  # the advice pasted where the script shards, before the rest
        exec(snippet_code, {"model": model, "fully_shard": fully_shard})
    for layer in (model[0], model[3]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _fsdp_trace(culprit: str, dtype: str) -> nanhunt.trace.Trace:
    from nanhunt.trace import Failure, Finding, LayerStats, RunInfo, TensorStats

    policy = {"param_dtype": dtype, "reduce_dtype": "float32", "output_dtype": None}
    trace = nanhunt.trace.Trace(run=RunInfo(target=dtype, device="cpu", world_size=2,
                                            fsdp_policies={"": policy, "0": policy,
                                                           "3": policy}))
    trace.layers = [LayerStats(module=m, type=t, calls=1, dtypes=[dtype],
                               forward=TensorStats(dtype=dtype, shape=[], numel=8, amax=1.0),
                               forward_amax_by_step={2: 1.0})
                    for m, t in (("0", "FSDPLinear"), ("1", "ReLU"), ("2", "Boost"),
                                 ("3", "FSDPLinear"))]
    stats = TensorStats(dtype=dtype, shape=[4, 16], numel=64, posinf=6)
    trace.first_failure = Failure(step=2, phase="forward", module=culprit, tensor="output",
                                  stats=stats)
    trace.diagnosis = Finding(rule="forward-overflow", kind="overflow", severity="error",
                              message="m", evidence=[], step=2, module=culprit)
    return trace


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_advice_under_fsdp2_is_a_policy_that_makes_the_module_compute_in_float32(dtype):
    """The advice for a module inside an FSDP2 unit with a half-precision param_dtype is a
    float32 unit of its own (autocast cannot change weights FSDP2 casts); pasted into a copy of
    the script, it makes that module compute in float32 and leaves the others in the policy."""
    name = str(dtype).removeprefix("torch.")
    trace = _fsdp_trace("2", name)
    advise(trace)
    rec = next(r for r in trace.recommendations if r.type == "fsdp_policy")
    assert rec.fix == [] and rec.code_change and "run_in_float32" not in rec.snippet
    seen = {}

    def record(module, args, out):
        seen[id(module)] = out.dtype

    hooks = [torch.nn.modules.module.register_module_forward_hook(record)]
    try:
        for code in (None, rec.snippet):
            seen.clear()
            model = _fsdp_model(dtype, code)
            model(torch.randn(4, 8))
            boost, last = seen[id(model[2])], seen[id(model[3])]
            assert boost == (torch.float32 if code else dtype)
            assert last == dtype  # the rest keeps its policy
    finally:
        for h in hooks:
            h.remove()


def test_an_fsdp2_reduce_scatter_in_float16_that_overflows_is_explained_with_the_policy():
    from nanhunt.trace import Failure, TensorStats

    trace = _fsdp_trace("0", "float16")
    trace.run.fsdp_policies["0"] = {"param_dtype": "float16", "reduce_dtype": "float16",
                                    "output_dtype": None}
    trace.diagnosis = None
    trace.first_failure = Failure(
        step=2, phase="communication", module="0", tensor="0.weight.grad",
        stats=TensorStats(dtype="float32", shape=[16, 8], numel=64, posinf=3),
        reduction="FSDP2 reduce-scatter of 0", reduce_dtype="float16")
    advise(trace)
    assert trace.diagnosis.rule == "reduction-overflow"
    assert "reduced in float16" in trace.diagnosis.message
    rec = next(r for r in trace.recommendations if r.type == "fsdp_policy")
    assert "reduce_dtype=torch.float32" in rec.snippet
    assert 'fully_shard(model.get_submodule("0"), mp_policy=policy)' in rec.snippet


def _stand_in_peer(monkeypatch, change=None) -> list[int]:
    """A second rank that sends what this one sends (``change`` edits its copy): the sizes of
    the gathers run are appended to the list returned."""
    from nanhunt.capture import shards

    calls: list[int] = []

    def all_gather(outs, mine, group=None):
        calls.append(mine.numel())
        for i, out in enumerate(outs):
            out.copy_(mine)
            if i == 1 and change is not None:
                change(out)

    monkeypatch.setattr(shards.ShardReducer, "world", lambda self: 2)
    monkeypatch.setattr(dist, "new_group", lambda **kw: "group")
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    return calls


def test_sharded_statistics_cross_ranks_in_one_gather_per_step(monkeypatch):
    """FSDP2 on one rank, with a stand-in peer holding an identical shard: every step gathers
    once (not once per tensor), the gradient norm's sums of squares add up across the ranks
    and the module's largest |gradient| is the larger of the shards'."""
    calls = _stand_in_peer(monkeypatch)
    model = _fsdp_model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    with nanhunt.watch(model, opt) as hunt:
        for step in range(3):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum() \
                .backward()
            grads = [p.grad.to_local() for p in model.parameters()]
            norms.append(float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))))
            amax0 = max(float(p.grad.to_local().abs().max()) for p in model[0].parameters())
            opt.step()
            opt.zero_grad()
    trace = hunt.trace()
    # each step: a 3-number header (which tensors, how many rows), then one gather of every
    # sharded row and sum of squares (not one per tensor)
    assert len(calls) == 6 and calls[0::2] == [3, 3, 3] and min(calls[1::2]) > 3
    for rec, norm in zip(trace.steps, norms):
        assert rec.grad_norm == pytest.approx(norm * 2 ** 0.5, rel=1e-6)
    layer0 = next(layer for layer in trace.layers if layer.module == "0")
    assert layer0.param_grad_amax_by_step[2] == amax0
    assert not any("reduction across ranks failed" in n for n in trace.notes)


def test_ranks_whose_shards_differ_turn_the_reduction_off_without_a_gather_of_unequal_sizes(
        monkeypatch):
    """A peer that holds other tensors (or another count of rows): the headers disagree, the
    rows are never gathered (gloo aborts the process on unequal sizes), and the report says the
    statistics are this rank's shards'."""
    def one_more_row(peer):
        peer[1] += 1

    calls = _stand_in_peer(monkeypatch, one_more_row)
    model = _fsdp_model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.watch(model, opt) as hunt:
        for step in range(3):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum() \
                .backward()
            opt.step()
            opt.zero_grad()
    trace = hunt.trace()
    assert calls == [3]  # the header once; then the reduction is off
    assert any("differ (not the same parameters)" in n for n in trace.notes), trace.notes


def test_the_ladder_reads_a_compression_hook_as_low_precision():
    """float32 everywhere, then bfloat16, for a float32 model whose gradients DDP compresses to
    float16 (no rung would otherwise change a precision)."""
    from nanhunt.experiment import ladder
    from nanhunt.trace import Experiment, Experiments, RunInfo, Trace

    trace = Trace(run=RunInfo(dtypes=["float32"], target_source="default",
                              comm_hooks=["fp16_compress_hook"]))
    assert [r.name for r in ladder.first_rungs(trace)] == ["control", "fp32"]
    ex = Experiments(runs=[Experiment(rung="fp32", fixes=["fp32-all"], outcome="trained")])
    assert [r.name for r in ladder.next_rungs(trace, ex)] == ["bf16"]
    trace.run.comm_hooks = []
    assert [r.name for r in ladder.first_rungs(trace)] == ["control"]


def test_the_precision_rungs_change_the_compression_too():
    """fp32-all registers no 16-bit compression hook (the fp32 rung then reduces as --fix
    comm-hook:none does, bit for bit); bf16 swaps fp16 for bf16 compression, one clear line
    where DDP refuses it."""
    fp32_losses, fp32_weights, _, message = _train("fp16", fixes=["fp32-all"])
    none_losses, none_weights, _, _ = _train("none")
    assert message is None and fp32_losses == none_losses
    assert all(torch.equal(a, b) for a, b in zip(fp32_weights, none_weights))
    if torch.version.cuda is None:
        with pytest.raises(FixMismatch, match=r"^--fix bf16: DDP refuses bf16_compress_hook"):
            _train("fp16", steps=1, fixes=["bf16"])


def _fsdp_reduce_run(reduce_dtype):
    """FSDP2 on one rank, float32 weights, gradients reduced in ``reduce_dtype``; step 1's
    gradients are scaled by hand far beyond float16's max."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=reduce_dtype)
    for unit in (model[0], model[2], model):
        fully_shard(unit, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    with nanhunt.watch(model, opt) as hunt:
        for step in range(3):
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)))
            opt.zero_grad()
            loss.pow(2).mean().backward(torch.tensor(1e7) if step == 1 else None)
            opt.step()
    trace = hunt.trace()
    advise(trace)
    return trace


def test_an_fsdp2_reduce_scatter_that_overflows_is_found_and_the_policy_advice_cures_it():
    trace = _fsdp_reduce_run(torch.float16)
    f = trace.first_failure
    assert (f.step, f.phase, f.module, f.tensor) == (1, "communication", "2", "2.weight.grad")
    assert (f.reduction, f.reduce_dtype) == ("FSDP2 reduce-scatter of 2", "float16")
    assert trace.diagnosis.rule == "reduction-overflow"
    rec = next(r for r in trace.recommendations if r.type == "fsdp_policy")
    assert "reduce_dtype=torch.float32" in rec.snippet
    assert "param_dtype=torch.float32" in rec.snippet  # the policy's own, kept
    # the advice applied to every unit (as its comment says): the same loop reduces in float32
    fixed = _fsdp_reduce_run(torch.float32)
    assert fixed.first_failure is None and not fixed.problem


def test_the_reports_say_how_the_gradient_was_reduced(fp16_run):
    import io

    from rich.console import Console

    from nanhunt.report.html import render_html
    from nanhunt.report.terminal import render_terminal

    _losses, _weights, trace = fp16_run
    expected = ("DDP all-reduce through fp16_compress_hook, in float16; this rank's gradient "
                f"before it: finite, amax {trace.first_failure.local_grad.amax:.3g}")
    out = io.StringIO()
    render_terminal(trace, Console(file=out, width=200, color_system=None))
    assert any(line.split() == ["reduced", *expected.split()]
               for line in out.getvalue().splitlines())
    assert f"Reduced across ranks: {expected}" in render_html(trace).replace("&#x27;", "'")


def test_the_sentinel_does_not_replay_a_sharded_model_and_says_why(tmp_path, capsys):
    """FSDP2's parameters are DTensors split across the ranks: one rank cannot replay its step
    alone. The sentinel copies nothing (no deepcopy of the sharded model, which FSDP refuses),
    reports the trip it saw with no cause, says why the step was not replayed, and writes
    nothing into the user's stderr."""
    model = _fsdp_model(torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanhunt.sentinel(model, opt, out=tmp_path / "out", stop=False) as hunt:
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            loss = model(x * (1e6 if step == 2 else 1.0)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    trace = hunt.trace()
    assert "internal error" not in capsys.readouterr().err
    ff = trace.first_failure
    assert ff is not None and ff.step == 2 and not ff.observed
    assert "not replayed" in ff.detail and "DTensor" in ff.detail
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert not report["diagnosis"]["kind"]  # no cause named for what was not observed
    assert any("split across the ranks" in n for n in trace.notes), trace.notes
    assert "step not replayed" in (tmp_path / "out" / "report.txt").read_text()


def test_a_replicated_dtensor_is_whole_on_every_rank_and_a_sharded_one_is_a_shard():
    """Tensor parallelism replicates a row-parallel layer's bias: each rank's local tensor is
    the whole of it, and adding the ranks' sums of squares would count it once per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from nanhunt.capture.shards import is_sharded

    mesh = init_device_mesh("cpu", (1,))
    t = torch.randn(4, 4)
    assert is_sharded(distribute_tensor(t, mesh, [Shard(0)]))
    assert not is_sharded(distribute_tensor(t, mesh, [Replicate()]))
    assert not is_sharded(t)


def test_the_sentinel_adds_the_ranks_shards_up_for_the_gradient_norm(monkeypatch, tmp_path):
    """The sentinel's one fused norm of the gradients: a sharded gradient's sum of squares is
    this rank's part, added to the peers' (here a stand-in peer with an identical shard), so
    the timeline's norm is the whole model's (it was this rank's shard's)."""
    _stand_in_peer(monkeypatch)
    model = _fsdp_model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    with nanhunt.sentinel(model, opt, out=None) as hunt:
        for step in range(3):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum() \
                .backward()
            norms.append(float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad.to_local(), dtype=torch.float64)
                 for p in model.parameters()]))))
            opt.step()
            opt.zero_grad()
    for rec, norm in zip(hunt.trace().steps, norms):
        assert rec.grad_norm == pytest.approx(norm * 2 ** 0.5, rel=1e-6)
