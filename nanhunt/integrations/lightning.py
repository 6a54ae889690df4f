"""nanhunt inside a Lightning run, in one line::

    import lightning as L
    from nanhunt.integrations.lightning import NanhuntCallback

    trainer = L.Trainer(precision="bf16-mixed", callbacks=[NanhuntCallback(out="nanhunt-report")])
    trainer.fit(model, loader)

Needs ``pip install "nanhunt[lightning]"``. See docs/integrations.md for the hook order and what
the callback sees that Lightning's own logs do not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanhunt._optional import require
from nanhunt.integrations._session import CallbackSession, precision_target

require("lightning")

import lightning  # noqa: E402  (after the one-line message for a missing extra)
from lightning.pytorch.callbacks import Callback  # noqa: E402

__all__ = ["NanhuntCallback"]


class NanhuntCallback(Callback):
    """Trace every training step of ``trainer.fit`` with nanhunt and report the first failure.

    Tracing starts when training starts (after Lightning's sanity check) and covers each
    training batch from ``on_train_batch_start`` to ``on_train_batch_end``: the forward and
    backward inside the optimizer's closure, gradient clipping, GradScaler (Lightning's
    ``MixedPrecision`` plugin holds it for ``16-mixed``) and the optimizer step. Validation,
    logging and checkpointing between batches are not traced. At the end of the batch where
    the first non-finite value appeared it sets ``trainer.should_stop`` (unless
    ``keep_going=True``); when training ends it writes report.json, report.html and
    report.txt into ``out`` (default ``<trainer.log_dir>/nanhunt-report``) on global rank 0,
    logs a one-line headline to the ``nanhunt`` logger, and prints the summary on stderr when
    the process ends (at once in a notebook or REPL): the script's stdout stays its own.

    Steps are optimizer steps, numbered like ``trainer.global_step`` (0-based: the step that
    ran while ``trainer.global_step`` was 5 is nanhunt's step 5); with
    ``accumulate_grad_batches=N`` one step spans N batches. The target format comes from
    ``trainer.precision`` (``bf16-mixed`` -> bfloat16, ``16-mixed`` -> float16; on CPU Lightning
    turns ``16-mixed`` into ``bf16-mixed``, and the target follows) unless ``target=`` is given.

    Options: ``out``, ``target``, ``keep_going``, ``mode`` (``"full"`` or ``"sampled"`` with
    ``sample_every``), ``keep_steps``, ``allow_inf``, ``tensorboard`` (``True`` for
    ``<log dir>/nanhunt``, or a folder), ``quiet``, ``strict``. After ``fit``,
    ``callback.trace`` is the run's :class:`~nanhunt.trace.Trace`.

    ``audit=True`` (or a format, or several: ``audit="float16,bfloat16"``) also runs the
    precision audit of ``nanhunt audit`` on ``audit_steps`` training batches (default 3) after
    ``audit_warmup`` plain ones (default 1): each module's SQNR in the format against float32
    on the batches the framework trains on, ranked, with checked fp32 advice for layers that
    stand out; the report gains its ``precision`` section. Training is not changed (the
    replays run on copies; see docs/integrations.md).

    >>> cb = NanhuntCallback(out="nanhunt-report", keep_going=True)
    >>> cb.session.keep_going
    True
    """

    def __init__(self, out: str | Path | None = None, **options: Any) -> None:
        super().__init__()
        self.session = CallbackSession(out=out, **options)

    @property
    def trace(self) -> Any:
        return self.session.trace

    # -- Lightning hooks, in the order Lightning calls them ------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        precision = str(trainer.precision)
        plugin = getattr(trainer, "precision_plugin", None)
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        tb_dir = None
        logger = trainer.logger
        if logger is not None and type(logger).__name__ == "TensorBoardLogger":
            tb_dir = Path(logger.log_dir) / "nanhunt"
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        self.session.start(
            pl_module,
            optimizer=optimizers[0] if optimizers else None,
            scaler=getattr(plugin, "scaler", None),
            target=precision_target(precision),
            target_source=f"precision ({precision})",
            out_dir=log_dir / "nanhunt-report",
            tb_dir=tb_dir or log_dir / "nanhunt-tensorboard",
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            framework=f"lightning {lightning.__version__}",
            first_step=trainer.global_step,
        )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self.session.step_begin()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.session.step_end(trainer.global_step):
            trainer.should_stop = True  # Lightning's own way to end fit() after this batch

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.finish("complete")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        status = "interrupted" if isinstance(exception, KeyboardInterrupt) else "crashed"
        self.session.finish(status, error=f"{type(exception).__name__}: {exception}")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.session.active:  # fit ended without on_train_end (e.g. no training batch)
            self.session.finish("complete")
