"""The precision audit from Lightning's callback: an MLP whose `body.2` layer computes (x + c) - c.

Lightning turns ``precision="16-mixed"`` into ``bf16-mixed`` on CPU: the run trains under
bfloat16 autocast, so the audit measures bfloat16 as the run computed it. `body.2` (Recenter)
adds c = 256 and takes it away again: bfloat16 spaces values near 256 two apart, so its output
loses nearly everything it had (catastrophic cancellation) while no value is ever non-finite.
``NanhuntCallback(audit=True)`` should rank `body.2` first and advise float32 for it; with
``--clean`` (no Recenter) no layer stands out and there is no advice.

    python examples/audit/lightning_audit.py                       # trains, prints each loss
    python examples/audit/lightning_audit.py --callback OUT        # NanhuntCallback(audit=True)
    python examples/audit/lightning_audit.py --callback OUT --clean

Options: ``--batches N`` (training batches, default 6), ``--audit-steps N``, ``--target FMT``
(the audit's format, default the run's own). The dropout and the BatchNorm layer in train mode
draw random numbers and update running statistics: the audit must leave both alone.
Modules: "" (Net), "body.0" (Linear), "body.1" (GELU), "body.2" (Recenter, not with --clean),
then Linear, BatchNorm1d, GELU, Dropout, Linear.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BATCH = 16


class Recenter(nn.Module):
    def __init__(self, offset: float = 256.0) -> None:
        super().__init__()
        self.offset = offset

    def forward(self, x):
        return (x + self.offset) - self.offset


class Net(L.LightningModule):
    def __init__(self, clean: bool) -> None:
        super().__init__()
        layers = [nn.Linear(16, 32), nn.GELU()] + ([] if clean else [Recenter()])
        layers += [nn.Linear(32, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Dropout(0.1),
                   nn.Linear(32, 4)]
        self.body = nn.Sequential(*layers)
        self.losses: list[float] = []

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        print(f"batch {batch_idx} loss {loss.item()!r}")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--clean", action="store_true")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--callback", metavar="OUT")
    p.add_argument("--audit-steps", type=int, default=3)
    p.add_argument("--target", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(BATCH * args.batches, 16)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    model = Net(args.clean)
    callbacks = []
    if args.callback:
        from nanhunt.integrations.lightning import NanhuntCallback

        callbacks.append(NanhuntCallback(out=args.callback, audit=args.target or True,
                                         audit_steps=args.audit_steps, quiet=True))
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, precision="16-mixed",
                        callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return {"losses": list(model.losses), "state": {k: v.detach().clone() for k, v in
                                                    model.state_dict().items()},
            "rng": torch.get_rng_state(), "callback": callbacks[0] if callbacks else None}


if __name__ == "__main__":
    main()
