"""nanhunt inside a Hugging Face ``Trainer`` run, in one line::

    from transformers import Trainer
    from nanhunt.integrations.transformers import NanhuntCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[NanhuntCallback(out="nanhunt-report")])
    trainer.train()

Needs ``pip install "nanhunt[transformers]"``. See docs/integrations.md for the hook order and
what the callback sees that the Trainer's own logs hide (``logging_nan_inf_filter``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanhunt._optional import require
from nanhunt.integrations._session import CallbackSession

require("transformers")

import transformers  # noqa: E402  (after the one-line message for a missing extra)
from transformers import TrainerCallback  # noqa: E402

__all__ = ["NanhuntCallback"]


class NanhuntCallback(TrainerCallback):
    """Trace every training step of ``Trainer.train`` with nanhunt and report the first failure.

    Tracing starts at ``on_train_begin`` and covers each optimizer step from ``on_step_begin``
    to ``on_step_end``: every micro-batch's forward and backward (``gradient_accumulation_steps``
    of them), ``clip_grad_norm_``, accelerate's GradScaler and the optimizer step. Evaluation,
    logging and saving between steps are not traced. At the end of the step where the first
    non-finite value appeared it sets ``control.should_training_stop`` (unless
    ``keep_going=True``); when training ends it writes report.json, report.html and report.txt
    into ``out`` (default ``<args.output_dir>/nanhunt-report``) on the main process, prints the
    summary on stderr when the process ends (at once in a notebook or REPL) and logs a headline
    to the ``nanhunt`` logger.

    Steps are optimizer steps numbered like ``state.global_step`` before the step (0-based): the
    Trainer's log line for a step whose loss was NaN shows the loss ``logging_nan_inf_filter``
    substituted, while nanhunt reports the NaN at that step. The target format is bfloat16 with
    ``bf16=True``, float16 with ``fp16=True``, unless ``target=`` is given.

    Options: ``out``, ``target``, ``keep_going``, ``mode`` (``"full"`` or ``"sampled"`` with
    ``sample_every``), ``keep_steps``, ``allow_inf``, ``tensorboard`` (``True`` for
    ``<output_dir>/nanhunt-tensorboard``, or a folder), ``quiet``, ``strict``. After
    ``train()``, ``callback.trace`` is the run's :class:`~nanhunt.trace.Trace`.

    ``audit=True`` (or a format, or several: ``audit="float16,bfloat16"``) also runs the
    precision audit of ``nanhunt audit`` on ``audit_steps`` training batches (default 3) after
    ``audit_warmup`` plain ones (default 1): each module's SQNR in the format against float32
    on the batches the framework trains on, ranked, with checked fp32 advice for layers that
    stand out; the report gains its ``precision`` section. Training is not changed (the
    replays run on copies; see docs/integrations.md).

    >>> cb = NanhuntCallback(out="nanhunt-report", target="bf16")
    >>> cb.session.target
    'bfloat16'
    """

    def __init__(self, out: str | Path | None = None, **options: Any) -> None:
        self.session = CallbackSession(out=out, **options)

    @property
    def trace(self) -> Any:
        return self.session.trace

    # -- Trainer events, in the order the Trainer sends them -----------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        optimizer = kwargs.get("optimizer")
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        target = "bfloat16" if args.bf16 else "float16" if args.fp16 else None
        setting = "bf16=True" if args.bf16 else "fp16=True" if args.fp16 else ""
        out = Path(args.output_dir or ".")
        self.session.start(
            model,
            optimizer=optimizer,
            target=target,
            target_source=f"precision ({setting})" if setting else "",
            out_dir=out / "nanhunt-report",
            tb_dir=out / "nanhunt-tensorboard",
            rank=args.process_index,
            world_size=args.world_size,
            framework=f"transformers {transformers.__version__}",
            first_step=state.global_step,
        )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.step_begin()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.session.step_end(state.global_step):
            control.should_training_stop = True  # the Trainer's own way to end train()
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.finish("complete")
