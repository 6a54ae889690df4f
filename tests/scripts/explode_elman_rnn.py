"""Fails: an Elman RNN (nn.RNN, tanh) trained through 60 time steps without gradient clipping;
its gradient norm grows by orders of magnitude while the forward stays bounded (tanh).

Autocast fp16 + GradScaler, fp32 parameters, SGD lr 0.1 (``--clip`` adds clip_grad_norm_ after
unscale_: the healthy control; ``--no-scaler --no-autocast`` is the float32 reference, where the
gradient norm grows the same way).  The recurrent weight starts with spectral radius 1.5 (a common
"long memory" init): back-propagated through 60 steps, the gradient of weight_hh is already ~30x
the head's at step 0, and the large updates it causes make later gradients larger still: the
gradient norm grows ~1000x within a few steps and the loss diverges.  The hidden state is a tanh,
so the forward stays in [-1, 1].
Expected: the gradient norm grows step over step, first in module "rnn" (its weight_hh gradient),
not in the decoder "head"; GradScaler then finds inf in the scaled gradients and skips steps.
Fix: torch.nn.utils.clip_grad_norm_ after scaler.unscale_(optimizer).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class SeqRegressor(nn.Module):
    def __init__(self, d_in=8, d_hidden=64):
        super().__init__()
        self.rnn = nn.RNN(d_in, d_hidden, nonlinearity="tanh", batch_first=True)
        self.head = nn.Linear(d_hidden, 1)
        with torch.no_grad():
            q, _ = torch.linalg.qr(torch.randn(d_hidden, d_hidden))
            self.rnn.weight_hh_l0.copy_(1.5 * q)

    def forward(self, x):
        h, _ = self.rnn(x)
        return self.head(h[:, -1]).squeeze(-1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--clip", action="store_true")
    parser.add_argument("--no-scaler", action="store_true")
    parser.add_argument("--no-autocast", action="store_true")
    args = parser.parse_args()

    model = SeqRegressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = None if args.no_scaler else torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x = 0.5 * torch.randn(32, 60, 8)
        y = x[:, :, 0].sum(1) / 8
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=not args.no_autocast):
            loss = F.mse_loss(model(x).float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            if args.clip:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
