"""TensorBoard export: a saved trace as scalars and histograms, one point per step.

Reads only the torch-free :class:`~nanhunt.trace.Trace` and writes event files with the
``tensorboard`` package's own writer (``pip install "nanhunt[tensorboard]"``); nothing here
imports torch. Tags (``<module>`` is the qualified module name, as in the report):

=============================  ==========================================================
``step/loss``                  the step's loss
``step/loss_scale``            GradScaler's scale during the step
``step/skipped``               1 when GradScaler skipped the step, else 0
``step/skipped_total``         steps skipped so far
``step/grad_norm``             global L2 norm of the unscaled parameter gradients
``forward_amax/<module>``      largest finite |output| of the module in the step
``forward_headroom/<module>``  binades from that amax to the target format's max
``forward_underflow/<module>`` fraction of non-zero finite outputs below the target's
                               smallest normal (last ``keep_steps`` steps)
``backward_*/<module>``        the same for the gradients w.r.t. the module's outputs, as
                               computed (multiplied by the loss scale under GradScaler)
``forward_exponent/<module>``  histogram of the outputs' binades (``floor(log2|x|)``), last
``backward_exponent/<module>`` ``keep_steps`` steps; zeros and non-finite values excluded
=============================  ==========================================================
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from nanhunt.errors import NanhuntError
from nanhunt.formats import get_format
from nanhunt.trace import TensorStats, Trace

__all__ = ["export_tensorboard"]


class _Writer:
    """The tensorboard package's event file writer, with scalar and histogram helpers."""

    def __init__(self, logdir: Path) -> None:
        from nanhunt._optional import require

        require("tensorboard")
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self._histo = Event, Summary, HistogramProto
        try:
            logdir.mkdir(parents=True, exist_ok=True)
            self._w = EventFileWriter(str(logdir), filename_suffix=".nanhunt")
        except OSError as exc:
            raise NanhuntError(f"cannot write TensorBoard events to {logdir}: "
                               f"{exc.strerror or exc}") from None
        self._wall = time.time()
        self.count = 0

    def _add(self, step: int, value: Any) -> None:
        self._w.add_event(self._event(wall_time=self._wall, step=step,
                                      summary=self._summary(value=[value])))
        self.count += 1

    def scalar(self, tag: str, step: int, value: float) -> None:
        # TensorBoard plots NaN and inf as they are: a non-finite loss stays visible
        self._add(step, self._summary.Value(tag=tag, simple_value=float(value)))

    def histogram(self, tag: str, step: int, hist: dict[int, int]) -> None:
        """Binade -> count as a histogram with one unit-wide bucket per binade."""
        if not hist:
            return
        keys = sorted(hist)
        num = sum(hist.values())
        proto = self._histo(
            min=float(keys[0]), max=float(keys[-1]), num=float(num),
            sum=float(sum(e * c for e, c in hist.items())),
            sum_squares=float(sum(e * e * c for e, c in hist.items())),
        )
        # bucket i counts values in (limit[i-1], limit[i]]: binade e sits in (e-0.5, e+0.5]
        proto.bucket_limit.append(keys[0] - 0.5)
        proto.bucket.append(0.0)
        for e in range(keys[0], keys[-1] + 1):
            proto.bucket_limit.append(e + 0.5)
            proto.bucket.append(float(hist.get(e, 0)))
        self._add(step, self._summary.Value(tag=tag, histo=proto))

    def close(self) -> None:
        self._w.close()


def export_tensorboard(trace: Trace, logdir: str | Path) -> int:
    """Write the trace's per-step series into ``logdir``; returns how many points were written.

    >>> from nanhunt.trace import StepRecord, Trace
    >>> import tempfile
    >>> trace = Trace(steps=[StepRecord(0, loss=1.5)])
    >>> export_tensorboard(trace, tempfile.mkdtemp())  # loss, skipped, skipped_total
    3
    """
    fmt = get_format(trace.run.target)
    w = _Writer(Path(logdir))
    try:
        skipped = 0
        for s in trace.steps:
            if s.loss is not None:
                w.scalar("step/loss", s.index, s.loss)
            if s.scale is not None:
                w.scalar("step/loss_scale", s.index, s.scale)
            skipped += int(s.skipped)
            w.scalar("step/skipped", s.index, float(s.skipped))
            w.scalar("step/skipped_total", s.index, float(skipped))
            if s.grad_norm is not None:
                w.scalar("step/grad_norm", s.index, s.grad_norm)
        detailed: set[tuple[str, int, str]] = set()
        for ls in trace.layer_steps:
            for side, st in (("forward", ls.forward), ("backward", ls.backward)):
                if st is not None:
                    detailed.add((ls.module, ls.step, side))
                    _layer_point(w, side, ls.module, ls.step, st)
        for sig in trace.signals:
            for g in sig.groups:
                for key, value in (("update_ratio", g.update_ratio),
                                   ("weight_norm", g.weight_norm),
                                   ("update_norm", g.update_norm), ("grad_norm", g.grad_norm),
                                   ("unchanged", g.unchanged), ("moment2_max", g.moment2_max),
                                   ("lr", g.lr)):
                    if value is not None:
                        w.scalar(f"group_{key}/{g.group}", sig.step, value)
        for layer in trace.layers:
            for step, amax in sorted(layer.logit_amax_by_step.items()):
                w.scalar(f"attention_logit_amax/{layer.module}", step, amax)
        for layer in trace.layers:
            for side, by_step in (("forward", layer.forward_amax_by_step),
                                  ("backward", layer.backward_amax_by_step)):
                for step, amax in sorted(by_step.items()):
                    if (layer.module, step, side) in detailed:
                        continue  # written with the full statistics above
                    w.scalar(f"{side}_amax/{layer.module}", step, amax)
                    if amax > 0:
                        w.scalar(f"{side}_headroom/{layer.module}", step,
                                 fmt.headroom_binades(amax))
    finally:
        w.close()
    return w.count


def _layer_point(w: _Writer, side: str, module: str, step: int, st: TensorStats) -> None:
    w.scalar(f"{side}_amax/{module}", step, st.amax)
    if st.amax > 0:  # no finite non-zero value: headroom is undefined, no point
        w.scalar(f"{side}_headroom/{module}", step, st.headroom)
    w.scalar(f"{side}_underflow/{module}", step, st.underflow_fraction)
    w.histogram(f"{side}_exponent/{module}", step, st.hist)
