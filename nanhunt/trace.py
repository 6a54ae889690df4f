"""The recorded run as plain, torch-free data: what capture produces and every later stage reads.

A :class:`Trace` can be saved to JSON (``Trace.to_json``), loaded (``Trace.from_json``) and
rendered again without torch or the user's script. JSON field names are an API, documented in
docs/report-schema.md; bump :data:`SCHEMA_VERSION` when they change.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from nanhunt.errors import NanhuntError

__all__ = [
    "PHASES",
    "SCHEMA_VERSION",
    "CastCounts",
    "Crash",
    "Experiment",
    "Experiments",
    "Failure",
    "Finding",
    "FixTry",
    "GroupSignal",
    "InputRange",
    "LayerStats",
    "LayerStep",
    "LoopCall",
    "OpRecord",
    "OptimizerInfo",
    "ParamGroupInfo",
    "PrecisionAudit",
    "PrecisionLayer",
    "PrecisionLoss",
    "RankSummary",
    "Recommendation",
    "RunInfo",
    "ScalerEvent",
    "SignalStep",
    "StepRecord",
    "TensorRecord",
    "TensorStats",
    "Trace",
    "Verification",
    "host_platform",
]

SCHEMA_VERSION = 2
#: versions this nanhunt reads (a field a version lacks takes its default)
READABLE_VERSIONS = (1, 2)

#: Phases in execution order within a step.
#: ``communication``: the gradient reduction across ranks (DDP's all-reduce, through a
#: communication hook when one is registered; FSDP2's reduce-scatter)
PHASES = ("data", "forward", "backward", "communication", "loss_scaling", "optimizer")


@dataclass
class TensorStats:
    """Summary of one tensor's values, judged against a target format.

    ``hist`` maps a binade ``e`` to the count of finite non-zero values with
    ``2**e <= |x| < 2**(e+1)``; binades below -126 are counted in -127.
    """

    dtype: str
    shape: list[int]
    numel: int
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    zero: int = 0
    amax: float = 0.0  # largest finite |x|, 0 when there is none
    amin: float = math.inf  # smallest non-zero finite |x|, inf when there is none
    overflow: int = 0  # finite values above the target max (NaN and inf are counted apart)
    underflow: int = 0  # non-zero finite values below the target's smallest normal
    flushed: int = 0  # non-zero finite values below the target's smallest subnormal
    headroom: float = math.inf  # binades from amax to the target max
    hist: dict[int, int] = field(default_factory=dict)

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    @property
    def finite_nonzero(self) -> int:
        return self.numel - self.nonfinite - self.zero

    @property
    def underflow_fraction(self) -> float:
        n = self.finite_nonzero
        return self.underflow / n if n else 0.0

    @property
    def flushed_fraction(self) -> float:
        n = self.finite_nonzero
        return self.flushed / n if n else 0.0

    def merged(self, other: TensorStats | None) -> TensorStats:
        """Statistics of the union of both tensors' values."""
        if other is None:
            return self
        hist = dict(self.hist)
        for k, v in other.hist.items():
            hist[k] = hist.get(k, 0) + v
        amax = max(self.amax, other.amax)
        return TensorStats(
            dtype=self.dtype if self.dtype == other.dtype else "mixed",
            shape=[],
            numel=self.numel + other.numel,
            nan=self.nan + other.nan,
            posinf=self.posinf + other.posinf,
            neginf=self.neginf + other.neginf,
            zero=self.zero + other.zero,
            amax=amax,
            amin=min(self.amin, other.amin),
            overflow=self.overflow + other.overflow,
            underflow=self.underflow + other.underflow,
            flushed=self.flushed + other.flushed,
            headroom=min(self.headroom, other.headroom),
            hist=hist,
        )


@dataclass
class TensorRecord:
    """One observed tensor in one step, in execution order."""

    step: int
    order: int
    phase: str
    module: str  # qualified module name; "" when no module owns it (the loss, a parameter's update)
    # "input[0]", "output", "output['logits']", "grad_output[0]", "fc.weight.grad", "loss"
    tensor: str
    # input | output | grad_output | grad_input | param_grad | reduced_grad | param | loss |
    # scaled_loss (reduced_grad: a gradient after the reduction across ranks, phase communication)
    role: str
    stats: TensorStats
    mutated: bool = False  # changed in place after it was summarised


@dataclass
class StepRecord:
    """One training step: an optimizer step, or a step GradScaler skipped."""

    index: int
    loss: float | None = None
    scale: float | None = None
    skipped: bool = False
    grad_norm: float | None = None  # global L2 norm of unscaled parameter gradients
    # a non-finite value that matters: on the path to a problem, or not absorbed (a -inf mask
    # a softmax consumed and a GradScaler skip are facts, not marks)
    nonfinite: bool = False
    records: int = 0  # how many tensors were summarised
    # GradScaler misuse seen in the step: "optimizer_on_scaled_grads" (optimizer.step() ran on
    # gradients still multiplied by the scale), "unscaled_loss" (scaler.step/update without
    # scaler.scale(loss): gradients divided by a scale they were never multiplied by)
    misuse: list[str] = field(default_factory=list)
    lr: float | None = None  # the first param group's learning rate when the step ran
    # whether the step's tensors were summarised (False: a step --sample-every skipped, where
    # only the loss and the gradient norm were checked); None in reports from before the field
    traced: bool | None = None


@dataclass
class CastCounts:
    """Gradient values at a cast to a narrower format in backward (the gradient of a module's
    low-precision output, computed in a wider dtype by what consumed it), over the recorded
    steps. ``values`` = ``source_zero`` + ``flushed`` + ``subnormal`` + normal + non-finite."""

    values: int = 0
    source_zero: int = 0  # already exactly zero before the cast
    flushed: int = 0  # non-zero before the cast, exactly zero after it
    subnormal: int = 0  # non-zero after the cast but below the format's smallest normal
    source_dtype: str = ""
    dtype: str = ""
    source_amax: float = 0.0  # largest |gradient| before the cast


@dataclass
class ScalerEvent:
    step: int
    event: str  # backoff | growth
    scale_before: float
    scale_after: float


@dataclass
class LayerStats:
    """One module's value ranges over the recorded steps."""

    module: str
    type: str
    calls: int = 0
    dtypes: list[str] = field(default_factory=list)
    forward: TensorStats | None = None  # outputs
    backward: TensorStats | None = None  # gradients w.r.t. outputs
    param_grad: TensorStats | None = None  # gradients of its own parameters (unscaled)
    forward_amax_by_step: dict[int, float] = field(default_factory=dict)
    backward_amax_by_step: dict[int, float] = field(default_factory=dict)
    param_amax_by_step: dict[int, float] = field(default_factory=dict)  # after each update
    # largest |gradient| of its own parameters by step, as stored (multiplied by the loss scale)
    param_grad_amax_by_step: dict[int, float] = field(default_factory=dict)
    grad_cast: CastCounts | None = None  # its output gradient at a cast to a narrower format
    params: int = 0  # elements of its own parameters (not its children's)
    # largest finite |input| of a softmax called in its own forward (attention scores before
    # softmax), by step; full tracing only
    logit_amax_by_step: dict[int, float] = field(default_factory=dict)


@dataclass
class LayerStep:
    """One module's ranges in one step, for per-step views (TensorBoard): kept for the last
    ``keep_steps`` steps only, so that a report stays small."""

    module: str
    step: int
    forward: TensorStats | None = None  # outputs
    backward: TensorStats | None = None  # gradients w.r.t. outputs, as computed (scaled)


@dataclass
class OpRecord:
    """One aten op seen while replaying the culprit."""

    index: int
    op: str
    phase: str  # forward | backward | optimizer
    dtype: str
    amax: float
    nonfinite: int
    numel: int
    source: str | None = None
    first_nonfinite: bool = False
    # Python numbers the op was called with (``x + 1e-12`` -> [1e-12]): an eps, a fill value
    scalars: list[float] = field(default_factory=list)
    zeros: int = 0  # exact zeros in its floating outputs (a denominator that became 0)
    # infinite values in its floating inputs: an op that made NaN from them (inf - inf, a
    # softmax over a row that is -inf throughout) rather than from finite values
    input_inf: int = 0


@dataclass
class InputRange:
    """One floating input of the culprit's failing call, measured exactly on the replay copy."""

    path: str  # "input[0]", "kwargs['mask']"
    dtype: str
    shape: list[int]
    min: float  # finite values only; 0.0 when there are none
    max: float
    amax: float  # largest finite |x|
    mean: float
    std: float
    nonfinite: int = 0


@dataclass
class Failure:
    """Where the first non-finite value on the path to the problem appeared."""

    step: int
    phase: str
    module: str
    tensor: str
    stats: TensorStats
    op: str | None = None
    source: str | None = None  # "path/to/file.py:123"
    source_line: str | None = None  # that line's text
    rank: int | None = None
    detail: str = ""
    bad_samples: dict[str, list[int]] = field(default_factory=dict)  # input -> sample indices
    batch_rows: int | None = None  # how many rows the batch of bad_samples had
    inputs: list[InputRange] = field(default_factory=list)  # the failing call's inputs (replay)
    # False: the value's origin was not observed (the module read weights that were already
    # non-finite, made so by code nanhunt does not watch): no cause may be named from it
    observed: bool = True
    # phase "communication": how the gradient was reduced ("DDP all-reduce through
    # fp16_compress_hook", "FSDP2 reduce-scatter"), the dtype the reduction ran in when known,
    # and this rank's own gradient before the reduction (None when it was not observed)
    reduction: str = ""
    reduce_dtype: str | None = None
    local_grad: TensorStats | None = None

    def where(self) -> str:
        parts = [f"step {self.step}", self.phase]
        if self.module:
            parts.append(self.module)
        parts.append(self.tensor)
        if self.op:
            parts.append(self.op)
        return " / ".join(parts)


@dataclass
class Finding:
    """A diagnosis (severity "error") or an at-risk warning, with the evidence behind it."""

    rule: str
    # overflow | underflow | nan_op | bad_input | exploding_gradient | lr_too_high | loss_scale
    kind: str
    severity: str  # error | warning | info
    message: str
    evidence: list[str] = field(default_factory=list)
    phase: str | None = None
    step: int | None = None
    module: str | None = None
    tensor: str | None = None
    score: float = 0.0  # ranking among warnings; larger is worse
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class FixTry:
    """One re-run of the script with fixes installed, and what it showed (re-run
    verification; docs/report-schema.md)."""

    fixes: list[str] = field(default_factory=list)  # the --fix specs installed
    verified: bool = False
    reason: str = ""  # what the run showed: why it counts, or why not
    steps: int = 0  # steps the re-run ran
    target_steps: int = 0  # steps it was to run (failure step + recovery), bounded by --max-steps
    losses: list[float | None] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # steps GradScaler skipped
    scale_first: float | None = None
    scale_last: float | None = None
    failure: str | None = None  # the re-run's own first failure, "step 6 / forward / wo / output"
    failure_step: int | None = None
    seconds: float = 0.0
    report: str | None = None  # the re-run's report.json, relative to the report folder
    # the conditions of "verified", each True, False or None (not applicable: no fp32 run):
    # control_reproduced, past_horizon, finite, no_skip_streak, learned, within_fp32_noise
    conditions: dict[str, bool | None] = field(default_factory=dict)


@dataclass
class Experiment:
    """One re-run of the experiment ladder: the script run again with one change (or none, the
    control), to a horizon, and what it showed (DESIGN.md §9; docs/report-schema.md)."""

    # control | fp32 | bf16 | fp32-master | no-scaler | init-scale | growth-interval | lr-0.1 |
    # lr-0.01 | clip | skip-batch | region (one step of the float32 bisection) | fix
    rung: str
    fixes: list[str] = field(default_factory=list)  # the --fix specs installed ([]: control)
    purpose: str = ""  # the question it answers, in words
    # recurred (a failure at the original's step) | moved (a first failure at another step) |
    # diverged (no failure traced, but a non-finite or blown-up loss, a skip streak, a problem)
    # | trained | crashed (the script raised) | stopped (no report, out of time) | not run
    outcome: str = "not run"
    detail: str = ""  # what the run showed, or why it did not run
    steps: int = 0  # steps the re-run ran
    target_steps: int = 0  # steps it was to run (the horizon), bounded by --max-steps
    ended: bool = False  # the script ran to its own end (fewer steps than the horizon)
    failure: str | None = None  # the re-run's first failure, "step 6 / forward / wo / output"
    failure_step: int | None = None
    losses: list[float | None] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    seconds: float = 0.0
    report: str | None = None  # the re-run's report.json, relative to the report folder


@dataclass
class Experiments:
    """The experiment ladder for the whole report: the control, the rungs, their verdict."""

    # the unfixed re-run failed the same way at the same step (None: no control ran)
    control_reproduced: bool | None = None
    # the control's losses before the failure step equal the original run's, bit for bit
    deterministic: bool | None = None
    spread: float | None = None  # largest |control - original| loss before the failure step
    failure_step: int | None = None  # the original's failing step the rungs are read against
    horizon: int = 0  # steps each re-run runs: max(2 x failure, failure + 20) + 1
    # not-reproduced | precision-range | precision-resolution | loss-scaling | optimisation |
    # data | not-precision | silent-precision | undetermined | "" (none reached)
    verdict: str = ""
    verdict_text: str = ""  # the verdict with the experiments that prove it
    source: str = ""  # experiments | rules (experiments could not run: see note)
    contradiction: str = ""  # a rule's cause the experiments contradict, and why it lost
    # the region bisection (float32 over the module tree, where float32 everywhere trained):
    # the --fix spec of the smallest region that removes the failure ("fp32:decoder.2"), or ""
    region: str = ""
    region_text: str = ""  # what the bisection found when it found no region, or why it stopped
    # the user's line where the control's op-by-op watch saw the first non-finite value made by
    # an op written there ("train.py:57"; "" when none was, or the op ran inside a module)
    source_line: str = ""
    # the source rung: the --fix spec of the narrowest lines whose float32 removed the failure
    # ("fp32-lines:train.py:56-57"), or ""
    lines: str = ""
    runs: list[Experiment] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)  # rungs the budget or Ctrl-C left out
    jobs: int = 1
    budget_seconds: float = 0.0
    seconds: float = 0.0
    interrupted: bool = False
    note: str = ""


@dataclass
class Verification:
    """How re-run verification went for the whole report."""

    tries_allowed: int = 0  # --verify N
    tries: int = 0  # re-runs made
    seconds: float = 0.0  # their wall time, together
    budget_seconds: float = 0.0  # about 3x the script's time to the failure
    script_seconds: float | None = None  # the original run's wall time to the failing step
    target_steps: int = 0
    interrupted: bool = False  # Ctrl-C stopped it
    note: str = ""  # why it did not run, or its limits (distributed runs)
    redirected: list[str] = field(default_factory=list)  # writes a re-run made, sent to scratch


@dataclass
class Recommendation:
    # init_scale | fp32_module | clip_grad_norm | lower_lr | eps | normalize_input | clamp |
    # fix_data
    type: str
    value: Any
    snippet: str
    evidence: list[str] = field(default_factory=list)
    module: str | None = None
    verified: bool = False  # a re-run of the script with the fix installed trained
    verification: str = ""  # what showed it (re-run, replay), or why it was not verified
    # how to apply it, for the replay: clamp {"where": "output", "bound"} or {"where": "input",
    # "min"}; fp32_module {"modules", "region", "cast_to", "region_ends"}; see docs/rules.md
    data: dict[str, Any] = field(default_factory=dict)
    fix: list[str] = field(default_factory=list)  # the --fix specs that install it; [] = code
    helper: str = ""  # a function the snippet calls (renderers show each helper once)
    check: str = ""  # how it was checked: "rerun", "replay" or "" (not checked)
    replay: str = ""  # what replaying the culprit with the fix showed
    code_change: bool = False  # it needs a change to the code: no --fix installs it
    tries: list[FixTry] = field(default_factory=list)  # re-runs made for it, narrowest first


@dataclass
class OptimizerInfo:
    """An optimizer the run stepped, as its first param group stood at its first step."""

    type: str  # class name: "Adam"
    lr: float | None = None
    eps: float | None = None  # None when the optimizer has no eps (SGD)
    param_dtypes: list[str] = field(default_factory=list)
    params: int = 0  # parameter tensors it steps
    source: str | None = None  # "train.py:57": where the script calls its step()
    source_line: str | None = None
    # how the script's code refers to it ("optimizer", "opt", "self.optimizer"); None when no
    # variable of the script's holds it
    name: str | None = None
    beta2: float | None = None  # the second-moment decay (Adam's betas[1]); None without one


@dataclass
class LoopCall:
    """A training-loop call nanhunt flagged (GradScaler misuse), at the user's line."""

    code: str  # a StepRecord.misuse code
    step: int  # the first step it was seen at
    source: str | None = None  # "train.py:57"
    source_line: str | None = None
    steps: int = 1  # how many steps it was seen at
    found_inf: bool = False  # GradScaler had found inf/NaN in the gradients of that step


@dataclass
class Crash:
    """The exception the script crashed with, located in the user's code."""

    type: str  # "RuntimeError"
    message: str
    source: str | None = None  # the innermost frame of the user's code: "train.py:57"
    source_line: str | None = None
    module: str | None = None  # the module whose forward was running, by qualified name
    step: int | None = None
    # numbers the raising line names through variables (``fill = 1e5; torch.full(s, fill)``)
    values: dict[str, float] = field(default_factory=dict)


@dataclass
class GroupSignal:
    """One optimizer param group at one applied step: the signals nanhunt measures every step
    (full tracing and the sentinel; docs/report-schema.md). Norms are L2 over the group's
    floating dense parameters that had a gradient."""

    group: str  # ParamGroupInfo.name: "Adam[0]" (the optimizer's class and the group's index)
    weight_norm: float | None = None  # after the update
    weight_norm_before: float | None = None  # before it
    update_norm: float | None = None  # of what the update changed (after - before)
    grad_norm: float | None = None  # of the gradients it stepped on (unscaled)
    unchanged: float | None = None  # fraction of its elements the update left exactly as they were
    moment2_max: float | None = None  # largest second-moment estimate (Adam's exp_avg_sq)
    moment2_mean: float | None = None  # its mean
    lr: float | None = None  # the group's lr at this step

    @property
    def update_ratio(self) -> float | None:
        """The update's norm over the weights' norm (Karpathy's update-to-weight ratio)."""
        if self.update_norm is None or not self.weight_norm:
            return None
        return self.update_norm / self.weight_norm


@dataclass
class SignalStep:
    """The per-group signals of one applied step (steps GradScaler skipped have none)."""

    step: int
    groups: list[GroupSignal] = field(default_factory=list)


@dataclass
class ParamGroupInfo:
    """An optimizer param group the signals name."""

    name: str  # "Adam[0]"; "Adam#2[0]" for the second optimizer of the same class
    optimizer: str  # class name
    index: int  # position in optimizer.param_groups
    tensors: int = 0  # parameter tensors
    elements: int = 0
    dtypes: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)  # the modules owning its parameters


@dataclass
class RankSummary:
    """One rank of a distributed run, as the merged report on rank 0 saw it."""

    rank: int
    answered: bool = True
    first_failure: Failure | None = None
    steps: list[StepRecord] = field(default_factory=list)
    status: str = "complete"  # complete | stopped | crashed | interrupted | no answer
    error: str | None = None  # the rank's exception when it crashed or was interrupted


@dataclass
class PrecisionLayer:
    """How much one module loses in the audited format (``nanhunt audit``).

    SQNR (signal-to-quantisation-noise ratio) in dB is ``10 log10(sum ref^2 / sum (x - ref)^2)``
    over every call in the audited steps; higher is better, ``inf`` means exact.
    """

    module: str
    type: str
    # its output in the target against its float32 replay on float32 copies of the same inputs
    sqnr_db: float | None = None
    # its output in the target against a float32 run of the whole model on the same batch
    sqnr_db_end_to_end: float | None = None
    # gradient w.r.t. its output, target backward against float32 backward (same batch)
    grad_sqnr_db: float | None = None
    # its floating inputs, the same way: the drift that reached it
    sqnr_db_end_to_end_in: float | None = None
    # sqnr_db_end_to_end_in - sqnr_db_end_to_end: how many dB the end-to-end SQNR drops
    # across the layer (positive: the drift grows there; inf: it starts there)
    drift_jump_db: float | None = None
    # the drift the layer adds, as an SQNR: -10 log10(relative noise out - relative noise in),
    # inf when it adds none (comparable with sqnr_db; see docs/rules.md)
    drift_added_db: float | None = None
    rank: int | None = None  # 1 = loses the most; null for a container a child explains
    calls: int = 0
    order: int = 0  # execution order of its first call
    depth: int = 0  # 0 for a model called at the top level
    leaf: bool = True  # no child modules
    parent: str | None = None  # the module that called it (null at the top level)
    dtype: str = ""  # dtype of its output in the target run
    explained_by: str | None = None  # a child module that loses as much (containers only)
    stands_out: bool = False  # loses far more than the rest (see docs/rules.md)
    reasons: list[str] = field(default_factory=list)  # why, in numbers
    # the numbers behind the reasons: cancellation_bits, swamping_bits, reduction_length,
    # adds, below_normal_fraction, above_max_fraction, dynamic_range_binades, periodic_arg_max
    data: dict[str, float] = field(default_factory=dict)


@dataclass
class PrecisionLoss:
    """The loss of one audited step computed in the target and in float32 on the same batch."""

    step: int
    target: float | None = None
    float32: float | None = None

    @property
    def error(self) -> float | None:
        """Relative error of the target's loss against float32's."""
        if self.target is None or self.float32 is None:
            return None
        if self.float32 == 0:
            return 0.0 if self.target == 0 else float("inf")
        return abs(self.target - self.float32) / abs(self.float32)


@dataclass
class PrecisionAudit:
    """Which layers lose accuracy in one target format; see docs/report-schema.md."""

    target: str
    # measured: the run itself computed in the target (replayed bit for bit); simulated: an
    # fp32 run, or another format than the run's, replayed as described in ``simulation``
    mode: str = "measured"
    simulation: str = ""
    steps: int = 0  # audited steps (forward + backward on one batch)
    layers: list[PrecisionLayer] = field(default_factory=list)  # execution order
    loss: PrecisionLoss | None = None  # the last audited step
    loss_by_step: list[PrecisionLoss] = field(default_factory=list)
    nominal_sqnr_db: float | None = None  # SQNR of rounding alone: 6.02 * mantissa bits + 13.8
    threshold_db: float | None = None  # layers with sqnr_db below this stand out
    reproduced: bool | None = None  # measured mode: the replay's loss equals the run's
    notes: list[str] = field(default_factory=list)
    compare: list[PrecisionAudit] = field(default_factory=list)  # --target a,b: the others
    seconds_audit: float | None = None  # wall time of the audit's own work, per audited step
    seconds_plain_step: float | None = None  # median warm-up step, when measured


@dataclass
class RunInfo:
    command: list[str] = field(default_factory=list)
    script: str = ""
    python: str = ""
    torch: str = ""
    nanhunt: str = ""
    platform: str = ""
    device: str = ""
    dtypes: list[str] = field(default_factory=list)
    target: str = "float16"
    world_size: int = 1
    autocast: bool = False
    scaler: bool = False
    started: str = ""
    finished: str = ""
    status: str = "complete"  # complete | stopped | crashed | interrupted | running
    error: str | None = None
    exit_code: int | None = None
    # where the target came from: option | autocast | parameters | precision (a framework's
    # setting, e.g. Lightning's "bf16-mixed") | default (nothing ran in low precision)
    target_source: str = ""
    framework: str = ""  # "lightning 2.6.6", "transformers 5.24.0" when a callback recorded it
    mode: str = "full"  # full | sentinel: how the steps were watched
    # DDP communication hooks registered on the model (by name), and each FSDP2 unit's
    # MixedPrecisionPolicy by module name ({"param_dtype", "reduce_dtype", "output_dtype"})
    comm_hooks: list[str] = field(default_factory=list)
    fsdp_policies: dict[str, dict[str, str | None]] = field(default_factory=dict)
    fixes: list[str] = field(default_factory=list)  # --fix specs installed in this run
    rerun: bool = False  # a verification re-run (NANHUNT_RERUN=1)
    # the script's GradScaler as it built it: init_scale, growth_factor, backoff_factor,
    # growth_interval (None: no scaler seen, or a report from before the field)
    scaler_settings: dict[str, float] | None = None


@dataclass
class Trace:
    """Everything nanhunt learned about a run. Torch-free; see docs/report-schema.md."""

    run: RunInfo = field(default_factory=RunInfo)
    steps: list[StepRecord] = field(default_factory=list)
    layers: list[LayerStats] = field(default_factory=list)
    first_failure: Failure | None = None
    problem: bool = False  # a real problem (not only facts or warnings) was found
    diagnosis: Finding | None = None
    warnings: list[Finding] = field(default_factory=list)
    recommendations: list[Recommendation] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)  # non-finite values seen that were not failures
    scaler_events: list[ScalerEvent] = field(default_factory=list)
    ops: list[OpRecord] = field(default_factory=list)  # op-level replay of the culprit
    ranks: list[RankSummary] = field(default_factory=list)
    # every rank of a distributed run answered and failed alike (same step, phase, module, tensor)
    all_ranks_failed: bool = False
    snapshot: str | None = None  # file name of the culprit snapshot, beside the report
    # unscaled gradient exponent histograms (binade -> count) by the gradients' dtype
    grad_hist: dict[str, dict[int, int]] = field(default_factory=dict)
    # per-module, per-step ranges of the last keep_steps steps (for nanhunt report --tensorboard)
    layer_steps: list[LayerStep] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # limits of this report (e.g. a stage failed)
    optimizers: list[OptimizerInfo] = field(default_factory=list)
    loop_calls: list[LoopCall] = field(default_factory=list)  # misused GradScaler calls
    crash: Crash | None = None  # the script's exception, when it crashed
    precision: PrecisionAudit | None = None  # nanhunt audit: per-layer accuracy in a format
    verification: Verification | None = None  # re-run verification, when it ran
    experiments: Experiments | None = None  # the experiment ladder (diagnosis by re-run)
    # per applied step, each optimizer param group's weight, update and gradient norms
    signals: list[SignalStep] = field(default_factory=list)
    param_groups: list[ParamGroupInfo] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    @property
    def partial(self) -> bool:
        return self.run.status in ("crashed", "interrupted", "running")

    def to_dict(self) -> dict[str, Any]:
        return _encode(self)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        if not isinstance(data, dict) or "schema_version" not in data:
            raise NanhuntError("not a nanhunt report (no schema_version)")
        version = data["schema_version"]
        if version not in READABLE_VERSIONS:
            raise NanhuntError(
                f"report schema version {version} is not supported (this nanhunt reads "
                f"version {SCHEMA_VERSION})"
            )
        try:
            return _decode(cls, data)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise NanhuntError(f"malformed nanhunt report: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> Trace:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise NanhuntError(f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_dict(data)


# ----------------------------------------------------------------------------- JSON codec
# Non-finite floats become the strings "nan", "inf", "-inf" (strict JSON); dict keys become
# strings and come back as the annotated key type.

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _encode(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    return obj


_HINTS: dict[type, dict[str, Any]] = {}


def _decode(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _decode(args[0], value) if len(args) == 1 else value
    if dataclasses.is_dataclass(tp):
        hints = _HINTS.get(tp) or _HINTS.setdefault(tp, typing.get_type_hints(tp))
        if not isinstance(value, dict):
            raise TypeError(f"expected an object for {tp.__name__}")
        kwargs = {
            f.name: _decode(hints[f.name], value[f.name])
            for f in dataclasses.fields(tp)
            if f.name in value
        }
        return tp(**kwargs)
    if origin is list:
        (item,) = typing.get_args(tp)
        return [_decode(item, v) for v in value]
    if origin is dict:
        ktype, vtype = typing.get_args(tp)
        return {_decode_key(ktype, k): _decode(vtype, v) for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):
            return _NONFINITE[value]
        return float(value)
    if tp is int:
        return int(value)
    return value


def _decode_key(tp: Any, key: str) -> Any:
    return int(key) if tp is int else key


def host_platform() -> str:
    """``RunInfo.platform``: the operating system, its release and the machine
    (``Linux-6.5.0-x86_64``). Not ``platform.platform()``: it runs ``uname -p`` in a subprocess,
    whose ``warnings.catch_warnings()`` resets the record of warnings already shown, so a
    script's own warnings would print a second time (a callback records its run mid-script)."""
    import platform

    return "-".join(x for x in (platform.system(), platform.release(), platform.machine()) if x)


#: the words with which the sentinel says it could not replay a step of a sharded model
SPLIT_ACROSS_RANKS = "split across the ranks"


def needs_locating(trace: Trace) -> bool:
    """A sentinel run whose failing step no rank could replay because its model's weights are
    split across the ranks (its origin not observed; not a copy over the memory cap): a
    full-tracing re-run of the job up to that step names the layer
    (:func:`nanhunt.cli.launch.locate`, run by nanhunt's launcher or by rank 0), and the
    in-script sentinel prints the command that runs one."""
    f = trace.first_failure
    return (trace.run.mode == "sentinel" and f is not None and not f.observed and
            "was not replayed" in (f.detail or "") and
            SPLIT_ACROSS_RANKS in (f.detail or ""))
