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
(with ``--callback``: also write the TensorBoard export).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BATCH, BAD_BATCH, BAD_SAMPLE, BATCHES = 8, 5, 3, 8


class Model(L.LightningModule):
    def __init__(self, arch: str, optimizer: str) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        if arch == "cnn":
            self.body = nn.Sequential(
                nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(),
                nn.Flatten(), nn.Linear(64, 1))
        else:
            self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.body(x), y)
        print(f"batch {batch_idx} global_step {self.trainer.global_step} loss {loss.item():.4f}")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

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
    args = p.parse_args()

    torch.manual_seed(0)
    x, y = torch.randn(BATCH * BATCHES, 16), torch.randn(BATCH * BATCHES, 1)
    x[BAD_BATCH * BATCH + BAD_SAMPLE, 2] = float("nan")
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)  # in order: batch i is rows i*8..
    val = DataLoader(TensorDataset(torch.randn(16, 16), torch.randn(16, 1)), batch_size=8)
    callbacks = []
    if args.callback:
        from nanhunt.integrations.lightning import NanhuntCallback

        callbacks.append(NanhuntCallback(out=args.callback, tensorboard=args.tensorboard or False,
                                         keep_going=args.keep_going))
    plugins = []
    precision = args.precision
    if args.scaler:
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins, precision = [MixedPrecision("16-mixed", "cpu")], None
    trainer = L.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, precision=precision, plugins=plugins,
        accumulate_grad_batches=args.accumulate, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=2 if args.validate else 0, val_check_interval=2 if args.validate
        else None, num_sanity_val_steps=2 if args.validate else 0,
    )
    trainer.fit(Model(args.arch, args.optimizer), loader, val if args.validate else None)
    print(f"done global_step {trainer.global_step} precision {trainer.precision}")


if __name__ == "__main__":
    main()
