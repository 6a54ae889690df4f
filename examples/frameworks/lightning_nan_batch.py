"""A Lightning run whose batch 5 carries a NaN sample (sample 3 of 8).

Lightning turns ``precision="16-mixed"`` into ``bf16-mixed`` on CPU, so the run trains under
bfloat16 autocast and the target is bfloat16. Expected first non-finite value: step 5 (the
optimizer step taken while ``trainer.global_step`` was 5), phase data, the model's input.

    python examples/frameworks/lightning_nan_batch.py                    # loss nan from batch 5
    nanhunt diagnose examples/frameworks/lightning_nan_batch.py          # step 5 / data
    python examples/frameworks/lightning_nan_batch.py --callback OUT     # with NanhuntCallback

Options: ``--arch mlp|cnn`` (the same failure in a small CNN), ``--optimizer sgd|lbfgs`` (LBFGS
calls its closure several times per step), ``--accumulate N`` (``accumulate_grad_batches``:
then the NaN batch 5 belongs to step 5 // N), ``--scaler`` (Lightning's MixedPrecision plugin
with float16 autocast and its GradScaler, as ``16-mixed`` runs on a GPU), ``--validate`` (a
validation loader: sanity check and a validation pass every 2 batches), ``--tensorboard DIR``
(with ``--callback``: also write the TensorBoard export), ``--fp16-head`` (``32-true`` with a
``.half()`` conv head whose float16 output overflows at step 0: target float16, from the
parameters),
``--devices 2`` (DDP on CPU, gloo:
each rank reads its own copy of the data in order, and only rank 1's has the NaN sample).
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BATCH, BAD_BATCH, BAD_SAMPLE, BATCHES = 8, 5, 3, 8


class Model(L.LightningModule):
    def __init__(self, arch: str, optimizer: str, fp16_head: bool = False) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.fp16_head = fp16_head
        if fp16_head:  # a conv net whose last conv runs in float16 with oversized weights
            self.body = nn.Sequential(nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 8, 3, padding=1),
                                      nn.ReLU())
            self.head = nn.Conv2d(8, 1, 4).half()
            with torch.no_grad():
                self.head.weight.fill_(3000.0)  # 128 positive inputs x 3000: past 65504
        elif arch == "cnn":
            self.body = nn.Sequential(
                nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(),
                nn.Flatten(), nn.Linear(64, 1))
        else:
            self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        if self.fp16_head:
            return self.head(self.body(x).half()).float().flatten(1)
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        print(f"batch {batch_idx} global_step {self.trainer.global_step} loss {loss.item()!r} "
              f"rank {self.global_rank}")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--optimizer", choices=["sgd", "lbfgs"], default="sgd")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--precision", default="16-mixed")
    p.add_argument("--scaler", action="store_true")
    p.add_argument("--validate", action="store_true")
    p.add_argument("--callback", metavar="OUT")
    p.add_argument("--tensorboard", metavar="DIR")
    p.add_argument("--keep-going", action="store_true")
    p.add_argument("--sample-every", type=int, default=1,
                   help="with --callback: the callback's sampled mode")
    p.add_argument("--sentinel", action="store_true", help="with --callback: sentinel mode")
    p.add_argument("--fp16-head", action="store_true",
                   help="32-true training with a .half() conv head that overflows at step 0")
    p.add_argument("--devices", type=int, default=1, help="DDP processes (gloo on CPU)")
    args = p.parse_args()

    torch.manual_seed(0)
    x, y = torch.randn(BATCH * BATCHES, 16), torch.randn(BATCH * BATCHES, 1)
    # under DDP each rank runs this script and reads its own copy in order; only rank 1's
    # copy has the NaN sample
    if args.devices == 1 or os.environ.get("LOCAL_RANK") == "1":
        x[BAD_BATCH * BATCH + BAD_SAMPLE, 2] = float("nan")
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)  # in order: batch i is rows i*8..
    val = DataLoader(TensorDataset(torch.randn(16, 16), torch.randn(16, 1)), batch_size=8)
    callbacks = []
    if args.callback:
        from nanhunt.integrations.lightning import NanhuntCallback

        mode = {"mode": "sampled", "sample_every": args.sample_every} \
            if args.sample_every > 1 else {"mode": "sentinel"} if args.sentinel else {}
        callbacks.append(NanhuntCallback(out=args.callback, tensorboard=args.tensorboard or False,
                                         keep_going=args.keep_going, **mode))
    plugins = []
    precision = "32-true" if args.fp16_head else args.precision
    if args.scaler:
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins, precision = [MixedPrecision("16-mixed", "cpu")], None
    trainer = L.Trainer(
        max_epochs=1, accelerator="cpu", devices=args.devices, precision=precision,
        plugins=plugins, strategy="ddp" if args.devices > 1 else "auto",
        accumulate_grad_batches=args.accumulate, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, limit_val_batches=2 if args.validate else 0,
        val_check_interval=2 if args.validate else None,
        num_sanity_val_steps=2 if args.validate else 0,
    )
    model = Model(args.arch, args.optimizer, args.fp16_head)
    trainer.fit(model, loader, val if args.validate else None)
    print(f"done global_step {trainer.global_step} precision {trainer.precision}")


if __name__ == "__main__":
    main()
