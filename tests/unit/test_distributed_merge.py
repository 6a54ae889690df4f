"""The merge of rank traces into one report (``merge_traces``), on hand-built traces: torch-free."""

from __future__ import annotations

import pytest

from nanhunt.distributed import RankResult, merge_traces
from nanhunt.report._common import verdict
from nanhunt.trace import PHASES, Failure, Finding, RunInfo, StepRecord, TensorStats, Trace


def failure(step: int, phase: str, module: str = "fc", tensor: str = "output") -> Failure:
    return Failure(
        step=step,
        phase=phase,
        module=module,
        tensor=tensor,
        stats=TensorStats(dtype="float16", shape=[2], numel=2, nan=1),
    )


def trace(
    ff: Failure | None = None, *, steps: int = 3, status: str = "stopped", error: str | None = None
) -> Trace:
    t = Trace(
        run=RunInfo(status=status, error=error),
        first_failure=ff,
        problem=ff is not None,
        steps=[StepRecord(index=i, loss=float(i)) for i in range(steps)],
    )
    if ff is not None:
        t.diagnosis = Finding(rule="r", kind="overflow", severity="error", message="m")
    return t


def merge(traces: dict[int, Trace | None], world_size: int) -> Trace:
    """``traces`` by rank, None for a rank that sent nothing."""
    return merge_traces(
        [RankResult(r, t) for r, t in traces.items() if t is not None],
        world_size,
        missing_reason="within 5 s",
    )


@pytest.mark.parametrize(
    ("failures", "origin"),
    [
        # an earlier step wins over an earlier phase
        ({0: (3, "data"), 1: (2, "optimizer"), 2: (3, "forward")}, 1),
        # within a step: data < forward < backward < loss_scaling < optimizer
        ({0: (2, "optimizer"), 1: (2, "loss_scaling"), 2: (2, "backward")}, 2),
        ({0: (2, "backward"), 1: (2, "forward"), 2: (2, "data")}, 2),
        ({0: (2, "loss_scaling"), 1: (2, "optimizer")}, 0),
        # a tie at different places goes to the lowest rank
        ({2: (1, "forward"), 1: (1, "forward")}, 1),
        # ranks without a failure do not count
        ({0: None, 1: (5, "backward"), 2: None}, 1),
    ],
)
def test_origin_is_the_earliest_by_step_then_phase_order(failures, origin):
    world = 3
    traces = {r: trace(failure(*f, module=f"m{r}") if f else None) for r, f in failures.items()}
    merged = merge({r: traces.get(r, trace()) for r in range(world)}, world)
    assert merged.first_failure is not None
    assert merged.first_failure.rank == origin
    assert merged.first_failure.module == f"m{origin}"  # the origin's own trace is the base
    assert not merged.all_ranks_failed
    assert f"on rank {origin}" in verdict(merged).headline
    assert [(r.rank, r.answered) for r in merged.ranks] == [(r, True) for r in range(world)]
    for r in merged.ranks:
        assert (r.first_failure is None) == (failures.get(r.rank) is None)
        if r.first_failure is not None:
            assert r.first_failure.rank == r.rank


def test_phase_order_is_the_capture_order():
    # the reduction across ranks follows backward (DDP's all-reduce, FSDP2's reduce-scatter)
    # and precedes GradScaler's unscale and the optimizer
    assert PHASES == ("data", "forward", "backward", "communication", "loss_scaling",
                      "optimizer")


def test_a_rank_that_received_the_nan_through_the_reduction_is_not_the_origin():
    """Rank 1's batch carried the NaN; rank 0 first saw it in the all-reduced gradient."""
    merged = merge({0: trace(failure(2, "communication", tensor="fc.weight.grad")),
                    1: trace(failure(2, "data", tensor="input[0]"))}, 2)
    assert merged.first_failure.rank == 1
    assert "rank 0 first at step 2, communication" in merged.first_failure.detail


def test_every_rank_failing_alike_is_flagged_and_said():
    merged = merge({r: trace(failure(3, "forward")) for r in range(3)}, 3)
    assert merged.all_ranks_failed
    assert merged.first_failure.rank == 0
    assert "every rank (3 of 3) failed alike" in merged.first_failure.detail.lower()
    assert verdict(merged).headline.endswith("module fc on every rank (3 of 3)")
    assert Trace.from_json(merged.to_json()).all_ranks_failed  # it is in the JSON


def test_alike_at_different_tensors_is_not_every_rank():
    merged = merge({0: trace(failure(3, "forward")), 1: trace(failure(3, "forward", "fc2"))}, 2)
    assert not merged.all_ranks_failed
    assert verdict(merged).headline.endswith(" on rank 0")


def test_alike_with_a_missing_rank_is_not_every_rank():
    merged = merge({0: trace(failure(3, "forward")), 1: trace(failure(3, "forward")), 2: None}, 3)
    assert not merged.all_ranks_failed
    assert "Every rank that answered (2 of 3) failed alike" in merged.first_failure.detail
    assert verdict(merged).headline.endswith(" on every rank that answered (2 of 3)")


def test_a_missing_rank_did_not_answer():
    merged = merge({0: trace(steps=4), 1: None, 2: trace(failure(1, "data"))}, 3)
    assert [(r.rank, r.answered, r.status) for r in merged.ranks] == [
        (0, True, "stopped"),
        (1, False, "no answer"),
        (2, True, "stopped"),
    ]
    missing = merged.ranks[1]
    assert (missing.first_failure, missing.steps, missing.error) == (None, [], None)
    assert any(n.startswith("rank 1 did not answer within 5 s") for n in merged.notes)
    assert merged.run.status == "crashed"
    assert merged.first_failure.rank == 2


def test_each_rank_keeps_its_status_error_and_steps():
    merged = merge(
        {
            0: trace(steps=2, status="crashed", error="Traceback\nRuntimeError: peer closed"),
            1: trace(failure(1, "backward"), steps=5),
            2: trace(steps=3, status="interrupted", error="KeyboardInterrupt"),
        },
        3,
    )
    assert [(r.status, r.error) for r in merged.ranks] == [
        ("crashed", "Traceback\nRuntimeError: peer closed"),
        ("stopped", None),
        ("interrupted", "KeyboardInterrupt"),
    ]
    assert [[s.index for s in r.steps] for r in merged.ranks] == [
        [0, 1],
        [0, 1, 2, 3, 4],
        [0, 1, 2],
    ]
    assert len(merged.steps) == 5  # the origin's timeline
    assert merged.run.error == "rank 0: Traceback\nRuntimeError: peer closed"


def test_merge_does_not_change_the_rank_traces():
    ff = failure(2, "data")
    own = trace(ff)
    merge({0: own, 1: trace()}, 2)
    assert ff.rank is None
    assert own.ranks == []
    assert not own.all_ranks_failed


def test_a_merged_trace_merged_again_is_not_stale():
    alike = merge({r: trace(failure(3, "forward")) for r in range(2)}, 2)
    assert alike.all_ranks_failed
    again = merge({0: trace(), 1: alike}, 2)
    assert not again.all_ranks_failed


def test_json_without_the_new_fields_loads_with_defaults():
    merged = merge({0: trace(failure(1, "data")), 1: None}, 2)
    data = merged.to_dict()
    del data["all_ranks_failed"]
    for r in data["ranks"]:
        del r["status"], r["error"]
    back = Trace.from_dict(data)
    assert not back.all_ranks_failed
    assert [(r.answered, r.status, r.error) for r in back.ranks] == [
        (True, "complete", None),
        (False, "complete", None),
    ]
