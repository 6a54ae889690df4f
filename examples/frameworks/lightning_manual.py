"""A Lightning module with manual optimisation whose batch 3 carries a NaN sample.

``automatic_optimization = False``: the module calls ``self.manual_backward(loss)``, clips and
steps its optimizer itself, and ``trainer.global_step`` counts those steps. Under
``bf16-mixed`` the target is bfloat16. Expected first non-finite value: step 3, phase data, the
model's input (sample 6 of the batch).

    python examples/frameworks/lightning_manual.py
    nanhunt diagnose examples/frameworks/lightning_manual.py
    python examples/frameworks/lightning_manual.py --callback OUT

``--arch rnn`` runs the same failure through a small GRU.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BATCH, BAD_BATCH, BAD_SAMPLE, BATCHES = 8, 3, 6, 6


class Manual(L.LightningModule):
    def __init__(self, arch: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.arch = arch
        if arch == "rnn":
            self.rnn = nn.GRU(4, 16, batch_first=True)
            self.head = nn.Linear(16, 1)
        else:
            self.body = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 1))

    def forward(self, x):
        if self.arch == "rnn":
            out, _ = self.rnn(x.view(x.shape[0], 3, 4))
            return self.head(out[:, -1])
        return self.body(x)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        print(f"batch {batch_idx} global_step {self.trainer.global_step} loss {loss.item():.4f}")
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", choices=["mlp", "rnn"], default="mlp")
    p.add_argument("--callback", metavar="OUT")
    args = p.parse_args()
    torch.manual_seed(0)
    x, y = torch.randn(BATCH * BATCHES, 12), torch.randn(BATCH * BATCHES, 1)
    x[BAD_BATCH * BATCH + BAD_SAMPLE, 5] = float("nan")
    callbacks = []
    if args.callback:
        from nanhunt.integrations.lightning import NanhuntCallback

        callbacks.append(NanhuntCallback(out=args.callback))
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, precision="bf16-mixed",
                        callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Manual(args.arch), DataLoader(TensorDataset(x, y), batch_size=BATCH))
    print(f"done global_step {trainer.global_step} precision {trainer.precision}")


if __name__ == "__main__":
    main()
