"""The recorder: queued rows of device summaries, the step's one transfer to the host, the ring
buffer of decoded steps, the step timeline and the per-module ranges."""

from __future__ import annotations

import copy
import math
from collections import deque
from typing import Any

import numpy as np
import torch

from nanhunt import stats as _stats
from nanhunt.capture.shards import ShardReducer
from nanhunt.capture.state import _LayerAcc, _merge_rows, _Meta, _StepData
from nanhunt.formats import NumberFormat
from nanhunt.trace import (
    CastCounts,
    GroupSignal,
    LayerStats,
    LayerStep,
    ScalerEvent,
    SignalStep,
    StepRecord,
    TensorRecord,
    TensorStats,
)

_HIST_OFFSET = 320  # gradient histograms span binades -320..319 (room to unscale)
HISTORY = 10_000  # steps of timeline and per-layer history kept (memory stays bounded)
#: steps whose per-module statistics (histograms, underflow) are kept for per-step views
LAYER_STEPS = 16


class Recorder:
    """Rows queued on the device during a step cross to the host in one transfer per step
    (:meth:`flush`); the host side keeps the last ``keep_steps`` steps' records in a ring, one
    :class:`~nanhunt.trace.StepRecord` per step and each module's ranges. Every decoded step is
    handed to ``judge`` (first failure, stop decision)."""

    def __init__(self, fmt: NumberFormat, keep_steps: int, types: dict[str, str],
                 judge: Any) -> None:
        self.format = fmt
        self.types = types  # module name -> class name (the naming's table)
        self.judge = judge
        self.step = 0  # the step scalars are filed under (the session's step in flight)
        self.dtypes: set[str] = set()
        self.scaler_events: list[ScalerEvent] = []
        self.metas: list[_Meta] = []  # this step's rows (and rows still queued from the last)
        self.flushed = 0  # how many of self.metas have crossed to the host
        self.pending_rows: list[torch.Tensor] = []
        self.pending_scalars: list[torch.Tensor] = []
        self.pending_scalar_keys: list[tuple[int, str]] = []
        # one more than asked: the step in flight, whose last rows arrive with the next transfer
        self.ring: deque[_StepData] = deque(maxlen=keep_steps + 1)
        self.step_records: dict[int, StepRecord] = {}
        self.step_order: deque[int] = deque(maxlen=max(keep_steps, HISTORY))
        self.accs: dict[str, _LayerAcc] = {}
        # step -> module -> [forward row, backward row, dtypes]: the last LAYER_STEPS steps
        self.by_step: dict[int, dict[str, list[Any]]] = {}
        self.grad_hist: dict[str, np.ndarray] = {}
        # module -> CastCounts of its output gradient at a down-cast, over the recorded steps
        self.casts: dict[str, CastCounts] = {}
        # signals (capture/signals.py): step -> param group -> name -> value, and module ->
        # step -> largest softmax input
        self.signals: dict[int, dict[str, dict[str, float]]] = {}
        self.softmax_amax: dict[str, dict[int, float]] = {}
        # sharded tensors' rows, reduced across ranks once per step (capture/shards.py)
        self.reducer = ShardReducer()

    def begin_step(self, step: int) -> None:
        """Rows still queued from the last step stay; the flushed ones are dropped."""
        self.step = step
        self.metas = self.metas[self.flushed:]
        self.flushed = 0

    @property
    def steps(self) -> list[StepRecord]:
        return [self.step_records[i] for i in self.step_order if i in self.step_records]

    def queue(self, t: torch.Tensor, meta: _Meta) -> int:
        self.pending_rows.append(_stats.summarize(t, self.format))
        self.metas.append(meta)
        self.dtypes.add(meta.dtype)
        return len(self.metas) - 1

    def scalar(self, value: torch.Tensor, key: str, step: int | None = None) -> None:
        """A device scalar of the step now recorded (loss, scale, found_inf, gradient norm), or
        of ``step`` (a signal measured after the step ended)."""
        self.pending_scalars.append(value.detach().reshape(-1)[:1].double())
        self.pending_scalar_keys.append((self.step if step is None else step, key))

    def signal_value(self, step: int, group: str, name: str, value: float) -> None:
        """A signal known on the host (a param group's lr)."""
        by_step = self.signals.get(step)
        if by_step is None:
            by_step = self.signals[step] = {}
            if len(self.signals) > HISTORY:
                del self.signals[min(self.signals)]
        by_step.setdefault(group, {})[name] = value

    def signal_steps(self) -> list[SignalStep]:
        """The per-group signals by step (capture/signals.py), oldest first."""
        fields = ("weight_norm", "weight_norm_before", "update_norm", "grad_norm", "unchanged",
                  "moment2_max", "moment2_mean", "lr")
        return [SignalStep(step, [GroupSignal(group=g, **{k: v.get(k) for k in fields})
                                  for g, v in groups.items()])
                for step, groups in sorted(self.signals.items())]

    def cast_counts(self, owner: str, numel: int, counts: torch.Tensor, source_dtype: str,
                    dtype: str) -> None:
        """A down-cast's counts (source zeros, flushed, subnormal, source amax) as device
        scalars: they cross with the step's one transfer."""
        cc = self.casts.get(owner)
        if cc is None:
            cc = self.casts[owner] = CastCounts(source_dtype=source_dtype, dtype=dtype)
        cc.values += numel  # known on the host
        for i, name in enumerate(("source_zero", "flushed", "subnormal", "source_amax")):
            self.pending_scalars.append(counts[i:i + 1])
            self.pending_scalar_keys.append((self.step, f"cast\0{owner}\0{name}"))

    def discard_step(self, step: int) -> None:
        """Drop the rows and scalars still queued for ``step`` (no step of its own)."""
        metas = self.metas[self.flushed:]
        keep = [i for i, m in enumerate(metas[:len(self.pending_rows)]) if m.step != step]
        self.pending_rows = [self.pending_rows[i] for i in keep]
        self.metas = self.metas[:self.flushed] + [metas[i] for i in keep]
        kept = [(v, k) for v, k in zip(self.pending_scalars, self.pending_scalar_keys)
                if k[0] != step]
        self.pending_scalars = [v for v, _ in kept]
        self.pending_scalar_keys = [k for _, k in kept]
        self.step_records.pop(step, None)

    def flush(self, step: int, parents: dict[int, int | None]) -> None:
        """Move every queued row to the host in one transfer and digest it; ``parents`` are
        the step's module calls (call id -> parent call id)."""
        rows, scalars, keys = self.pending_rows, self.pending_scalars, self.pending_scalar_keys
        if not rows and not scalars:
            return
        metas = self.metas[self.flushed:self.flushed + len(rows)]
        self.flushed += len(rows)
        devices = {p.device for p in (*rows, *scalars)}
        if len(devices) == 1:
            parts = ([torch.stack(rows).reshape(-1)] if rows else []) + scalars
            flat = torch.cat(parts).cpu().numpy()
        else:  # model parallel: one transfer per piece's device
            flat = np.concatenate([r.cpu().numpy() for r in rows]
                                  + [x.cpu().numpy() for x in scalars])
        n = len(rows) * _stats.ROW_LEN
        matrix = flat[:n].reshape(len(rows), _stats.ROW_LEN)
        values = flat[n:]
        self.pending_rows, self.pending_scalars, self.pending_scalar_keys = [], [], []
        self.data_for(step).parents.update(parents)
        whole = self.reduce_shards(metas, matrix, keys, values)
        self.digest(metas, matrix, list(zip(keys, values)), whole)

    def reduce_shards(self, metas: list[_Meta], matrix: np.ndarray, keys: list,
                      values: np.ndarray) -> dict[int, np.ndarray]:
        """The whole tensors' rows of the sharded ones (by index in ``metas``), from every
        rank's shard rows in one gather; ``values`` of sharded sums of squares become the
        whole sums in place. Empty without peers (the shard is then the whole)."""
        rows = [i for i, m in enumerate(metas) if m.sharded]
        sums = [j for j, (_step, key) in enumerate(keys) if key == "grad_sumsq_sharded"]
        if not rows and not sums:
            return {}
        extra = np.zeros((1, _stats.ROW_LEN))
        extra[0, :len(sums)] = [values[j] for j in sums]
        block = np.concatenate([matrix[rows], extra]) if rows else extra
        names = [f"{metas[i].step}:{metas[i].tensor}" for i in rows] + \
            [f"{keys[j][0]}:sumsq" for j in sums]
        blocks = self.reducer.gather(names, block)
        if blocks is None:
            return {}
        merged = blocks[0].copy()
        for other in blocks[1:]:
            for r in range(len(rows)):
                merged[r] = _merge_rows(merged[r], other[r])
            merged[-1] += other[-1]
        for k, j in enumerate(sums):
            values[j] = merged[-1, k]
        return {i: merged[r] for r, i in enumerate(rows)}

    def data_for(self, step: int) -> _StepData:
        for d in reversed(self.ring):
            if d.index == step:
                return d
        d = _StepData(index=step)
        self.ring.append(d)
        return d

    def find_step(self, step: int | None) -> _StepData | None:
        if not self.ring:
            return None
        if step is None:
            return self.ring[-1]
        for d in self.ring:
            if d.index == step:
                return d
        return None

    def digest(self, metas: list[_Meta], matrix: np.ndarray, scalars: list,
               whole: dict[int, np.ndarray] | None = None) -> None:
        """File decoded rows and scalars under their steps; ``whole`` holds the whole tensors'
        rows of sharded ones (by index), which the module ranges take instead of the shard's
        (the judge reads this rank's own)."""
        touched: dict[int, _StepData] = {}
        new = metas
        for (step, key), value in scalars:
            if key.startswith(("sig\0", "smax\0")):  # signals: no step record to redo
                self._signal(step, key, float(value))
                continue
            d = touched.get(step) or touched.setdefault(step, self.data_for(step))
            if key == "loss":
                # several backwards in one step (gradient accumulation): the last loss, but a
                # non-finite one sticks (an earlier micro-batch's NaN is the step's problem)
                if d.loss is None or math.isfinite(d.loss):
                    d.loss = float(value)
            elif key == "scale" or key == "scale_before":
                d.scale = float(value)
            elif key == "scale_after":
                d.scale_after = float(value)
            elif key == "found_inf":
                d.found_inf = bool(value > 0)
            elif key in ("grad_sumsq", "grad_sumsq_sharded"):  # one per optimizer that stepped
                d.grad_sumsq = (d.grad_sumsq or 0.0) + float(value)
            elif key.startswith("cast\0"):
                _, owner, name = key.split("\0")
                cc = self.casts[owner]
                if name == "source_amax":
                    cc.source_amax = max(cc.source_amax, float(value))
                else:
                    setattr(cc, name, getattr(cc, name) + int(value))
        arrived = []
        whole = whole or {}
        for i, (meta, row) in enumerate(zip(new, matrix)):
            if meta.approx is not None:
                row[0] = math.prod(meta.shape)
            d = touched.get(meta.step) or touched.setdefault(meta.step,
                                                             self.data_for(meta.step))
            d.metas.append(meta)
            d.rows.append(row)
            arrived.append((meta, whole.get(i, row), d))
        for step in sorted(touched):
            self.update_step(touched[step])
        for meta, row, d in arrived:
            if self.judge.before_failure(meta) and not (meta.phase == "backward"
                                                        and d.found_inf and d.problem is None):
                # (gradients of a step GradScaler skipped overflowed on purpose: not a range)
                self.accumulate(meta, row, d)

    def _signal(self, step: int, key: str, value: float) -> None:
        if key.startswith("smax\0"):
            by_step = self.softmax_amax.setdefault(key[5:], {})
            by_step[step] = max(by_step.get(step, 0.0), value)
            return
        _, group, name, how = key.split("\0")
        if how == "sqrt":  # a sum of squares
            value = math.sqrt(value) if value >= 0 else math.nan
        self.signal_value(step, group, name, value)

    def accumulate(self, meta: _Meta, row: np.ndarray, d: _StepData) -> None:
        if meta.approx is not None and meta.role != "param":
            return  # a flags-only row (a sentinel's gradient check): no range to add
        if meta.phase == "backward" or meta.role == "param_grad":  # (FSDP2's: communication)
            self.add_grad_hist(meta.dtype, row, d.scale)
        for owner in (meta.owner, *meta.also_owners):
            if owner:
                self.accumulate_into(owner, meta, row)

    def accumulate_into(self, owner: str, meta: _Meta, row: np.ndarray) -> None:
        acc = self.accs.get(owner)
        if acc is None:
            acc = self.accs[owner] = _LayerAcc(owner, self.types.get(owner, ""))
        if meta.role == "output":
            acc.calls += 1
            acc.dtypes.add(meta.dtype)
            acc.forward = _merge_rows(acc.forward, row)
            acc.fwd_by_step[meta.step] = max(acc.fwd_by_step.get(meta.step, 0.0), float(row[5]))
            self._add_step_row(meta, owner, 0, row)
        elif meta.role == "grad_output" or (meta.role == "grad_input" and meta.owner):
            acc.backward = _merge_rows(acc.backward, row)
            acc.bwd_by_step[meta.step] = max(acc.bwd_by_step.get(meta.step, 0.0), float(row[5]))
            self._add_step_row(meta, owner, 1, row)
        elif meta.role == "param_grad":
            acc.param_grad = _merge_rows(acc.param_grad, row)
            acc.pgrad_dtypes.add(meta.dtype)
            # per step too: which module's gradients grow first (exploding gradients)
            acc.pgrad_by_step[meta.step] = max(acc.pgrad_by_step.get(meta.step, 0.0),
                                               float(row[5]))
        elif meta.role == "param":
            acc.param_by_step[meta.step] = max(acc.param_by_step.get(meta.step, 0.0),
                                               float(row[5]))

    def _add_step_row(self, meta: _Meta, owner: str, side: int, row: np.ndarray) -> None:
        step = self.by_step.get(meta.step)
        if step is None:
            step = self.by_step[meta.step] = {}
            for old in [k for k in self.by_step if k <= meta.step - LAYER_STEPS]:
                del self.by_step[old]
        entry = step.setdefault(owner, [None, None, set(), set()])
        entry[side] = _merge_rows(entry[side], row)
        entry[2 + side].add(meta.dtype)

    def layer_steps(self) -> list[LayerStep]:
        """Each module's forward and backward statistics per step, the last LAYER_STEPS
        steps."""
        def conv(row: np.ndarray | None, dtypes: set[str]) -> TensorStats | None:
            if row is None:
                return None
            dtype = "mixed" if len(dtypes) > 1 else next(iter(dtypes), "float32")
            return _stats.decode(row, dtype, [], self.format)

        return [LayerStep(module, step, forward=conv(e[0], e[2]), backward=conv(e[1], e[3]))
                for step, modules in sorted(self.by_step.items())
                for module, e in modules.items()]

    def add_grad_hist(self, dtype: str, row: np.ndarray, scale: float | None) -> None:
        """Add a gradient's exponent histogram, unscaled, to the run's histogram."""
        shift = 0
        if scale and scale > 0 and math.isfinite(scale):
            shift = round(math.log2(scale))
        hist = self.grad_hist.get(dtype)
        if hist is None:
            hist = self.grad_hist[dtype] = np.zeros(2 * _HIST_OFFSET, dtype=np.float64)
        lo = _HIST_OFFSET + 1 - 127 - shift  # index of exponent-field 1's binade
        if lo >= 0 and lo + 254 <= len(hist):
            hist[lo:lo + 254] += row[_stats._HEAD + 1:_stats._HEAD + 255]

    def grad_histograms(self) -> dict[str, dict[int, int]]:
        """Unscaled gradient exponent histograms (binade -> count), by gradient dtype."""
        out = {}
        for dtype, hist in self.grad_hist.items():
            nz = np.nonzero(hist)[0]
            out[dtype] = {int(i) - _HIST_OFFSET: int(hist[i]) for i in nz}
        return out

    def step_record(self, index: int) -> StepRecord:
        """The step's record, made on first use; the oldest are dropped past HISTORY steps."""
        rec = self.step_records.get(index)
        if rec is None:
            rec = self.step_records[index] = StepRecord(index=index)
            if len(self.step_order) == self.step_order.maxlen:
                self.step_records.pop(self.step_order[0], None)
            self.step_order.append(index)
            if index % max(1, HISTORY // 10) == 0:
                self.prune_history(index - HISTORY)
        return rec

    def prune_history(self, oldest: int) -> None:
        for acc in self.accs.values():
            for by_step in (acc.fwd_by_step, acc.bwd_by_step, acc.param_by_step,
                            acc.pgrad_by_step, self.softmax_amax.get(acc.module, {})):
                for k in [k for k in by_step if k < oldest]:
                    del by_step[k]

    def update_step(self, d: _StepData) -> None:
        rec = self.step_record(d.index)
        rec.loss = d.loss
        rec.scale = d.scale
        nonfinite = [m for m, r in zip(d.metas, d.rows) if r[1] + r[2] + r[3] > 0]
        rec.nonfinite = bool(nonfinite) or (d.loss is not None and not math.isfinite(d.loss))
        rec.records = len(d.metas)
        if d.scale_after is not None and d.scale is not None:
            rec.skipped = bool(d.found_inf) if d.found_inf is not None else d.scale_after < d.scale
            if d.applied_anyway:
                rec.skipped = False  # the optimizer applied it outside scaler.step()
            if d.scale_after != d.scale and len(self.scaler_events) < HISTORY and not (
                    self.scaler_events and self.scaler_events[-1].step >= d.index):
                self.scaler_events.append(ScalerEvent(
                    d.index, "backoff" if d.scale_after < d.scale else "growth",
                    d.scale, d.scale_after))
        if d.grad_sumsq is not None:
            rec.grad_norm = math.sqrt(d.grad_sumsq) if math.isfinite(d.grad_sumsq) else \
                float("nan")
        self.judge.judge(d, rec)

    def stats(self, m: _Meta, row: np.ndarray) -> TensorStats:
        if m.approx is not None:  # a cheap row: summarise the tensor exactly now (a failure)
            t = m.approx()
            if t is not None:
                row = _stats.summarize(t, self.format).cpu().numpy()
        return _stats.decode(row, m.dtype, m.shape, self.format)

    def tensor_record(self, m: _Meta, row: np.ndarray) -> TensorRecord:
        return TensorRecord(step=m.step, order=m.order, phase=m.phase, module=m.module,
                            tensor=m.tensor, role=m.role, stats=self.stats(m, row),
                            mutated=m.mutated)

    def layer_stats(self, acc: _LayerAcc) -> LayerStats:
        def conv(row: np.ndarray | None, dtypes: set[str] | None = None) -> TensorStats | None:
            if row is None:
                return None
            dtypes = acc.dtypes if dtypes is None else dtypes
            return _stats.decode(row, "mixed" if len(dtypes) > 1 else
                                 next(iter(dtypes), "float32"), [], self.format)

        return LayerStats(
            module=acc.module, type=acc.type, calls=acc.calls, dtypes=sorted(acc.dtypes),
            forward=conv(acc.forward), backward=conv(acc.backward),
            # the parameters' own dtype, not the outputs' (fp32 weights under fp16 autocast)
            param_grad=conv(acc.param_grad, acc.pgrad_dtypes),
            forward_amax_by_step=dict(acc.fwd_by_step),
            backward_amax_by_step=dict(acc.bwd_by_step),
            param_amax_by_step=dict(acc.param_by_step),
            param_grad_amax_by_step=dict(acc.pgrad_by_step),
            grad_cast=copy.copy(self.casts.get(acc.module)),
            logit_amax_by_step=dict(self.softmax_amax.get(acc.module, {})),
        )

    def records(self, step: int | None = None) -> list[TensorRecord]:
        """Decoded tensor records of a step still in the ring buffer (default: the last)."""
        data = self.find_step(step)
        if data is None:
            return []
        return [self.tensor_record(m, r) for m, r in sorted(
            zip(data.metas, data.rows), key=lambda mr: mr[0].order)]
