"""The precision audit from the Hugging Face Trainer's callback, on an fp32 run.

The Trainer trains in float32 on CPU here (no ``bf16``/``fp16``), so the audit simulates its
target: ``NanhuntCallback(audit="float16")`` replays each audited batch under
``torch.autocast("cpu", float16)`` and measures every module against float32 on the same batch,
as ``nanhunt audit --target float16`` would for the same script. `body.2` (Recenter) computes
(x + c) - c with c = 256: float16 spaces values near 256 a quarter apart, so it loses most of
its input's precision (catastrophic cancellation) while nothing is ever non-finite. It should
rank first with a checked fp32 advice; with ``--clean`` (no Recenter) no layer stands out.

    python examples/audit/hf_trainer_audit.py                       # trains in float32
    python examples/audit/hf_trainer_audit.py --callback OUT        # NanhuntCallback(audit=...)
    python examples/audit/hf_trainer_audit.py --callback OUT --clean

Options: ``--target FMT`` (default float16), ``--audit-steps N``, ``--output-dir DIR``.
The model records each loss it computes in a list attribute (``seen_losses``) and has dropout
and a train-mode LayerNorm-free BatchNorm: the audit's replays must leave all three alone.
Modules: "" (Net), "body.0" (Linear), "body.1" (GELU), "body.2" (Recenter, not with --clean),
then Linear, BatchNorm1d, GELU, Dropout, Linear.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

N, BATCH = 96, 16


class Samples(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 16, generator=g)
        self.y = (self.x[:, 0] > 0).long() + 2 * (self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class Recenter(nn.Module):
    def __init__(self, offset: float = 256.0) -> None:
        super().__init__()
        self.offset = offset

    def forward(self, x):
        return (x + self.offset) - self.offset


class Net(nn.Module):
    def __init__(self, clean: bool) -> None:
        super().__init__()
        layers = [nn.Linear(16, 32), nn.GELU()] + ([] if clean else [Recenter()])
        layers += [nn.Linear(32, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Dropout(0.1),
                   nn.Linear(32, 4)]
        self.body = nn.Sequential(*layers)
        self.seen_losses: list[float] = []  # Python state the audit's replays must not touch

    def forward(self, x, labels=None):
        logits = self.body(x)
        loss = nn.functional.cross_entropy(logits.float(), labels)
        self.seen_losses.append(loss.item())
        return {"loss": loss, "logits": logits}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--clean", action="store_true")
    p.add_argument("--callback", metavar="OUT")
    p.add_argument("--target", default="float16")
    p.add_argument("--audit-steps", type=int, default=3)
    p.add_argument("--output-dir", default="hf-audit-output")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = Net(args.clean)
    callbacks = []
    if args.callback:
        from nanhunt.integrations.transformers import NanhuntCallback

        callbacks.append(NanhuntCallback(out=args.callback, audit=args.target,
                                         audit_steps=args.audit_steps, quiet=True))
    targs = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=BATCH, num_train_epochs=1,
        use_cpu=True, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, learning_rate=1e-2, seed=0,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Samples(), callbacks=callbacks)
    trainer.train()
    print("losses", model.seen_losses)
    return {"losses": list(model.seen_losses),
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "rng": torch.get_rng_state(), "callback": callbacks[0] if callbacks else None}


if __name__ == "__main__":
    main()
