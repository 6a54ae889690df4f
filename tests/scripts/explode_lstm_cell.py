"""Fails: a hand-written LSTM cell unrolled over 50 steps, trained without gradient clipping;
the gradients through time explode while the forward stays bounded.

Autocast fp16 + GradScaler, fp32 parameters, SGD lr 0.2 (``--no-autocast --no-scaler``: the
float32 reference; ``--clip`` adds clip_grad_norm_ after unscale_, which is not enough here: the
fp16 backward itself overflows, so GradScaler skips every step with or without clipping).  The cell
("cell", LSTMCellHandmade: one Linear for the four gates) starts with its forget-gate bias at +3
(a common trick for long memory), a recurrent weight of std 0.3, and emits h = o * c without
the tanh on the cell state: the cell state keeps most of its past, and the gradient that flows back
through 50 steps is amplified through h -> gates -> c.  In float32 the cell's gradient norm is
~1.7e4 at step 0 and ~1e7-1e8 at steps 1-3, while the head's stays below ~100.  The readout
"head" is a Linear on the last hidden state.
Expected (20 steps): GradScaler skips steps 0-11 calibrating the scale down to 16, applies step
12 with a gradient norm of ~7e3 (the loss jumps from ~3.5 to ~10.6), and from step 13 the
gradients overflow fp16 at every scale: the scale collapses below 1 while the loss stays finite.
The module whose gradient grows is "cell" (not "head").
Fix: torch.nn.utils.clip_grad_norm_ after scaler.unscale_(optimizer).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class LSTMCellHandmade(nn.Module):
    def __init__(self, d_in, d_hidden):
        super().__init__()
        self.gates = nn.Linear(d_in + d_hidden, 4 * d_hidden)
        with torch.no_grad():
            self.gates.weight[:, d_in:].normal_(0, 0.3)
            self.gates.bias.zero_()
            self.gates.bias[d_hidden:2 * d_hidden] = 3.0  # forget gate

    def forward(self, x, state):
        h, c = state
        i, f, g, o = self.gates(torch.cat([x, h], -1)).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * c  # no tanh on the cell state (a "linear" output)
        return h, c


class SeqClassifier(nn.Module):
    def __init__(self, d_in=8, d_hidden=48, n_classes=4):
        super().__init__()
        self.d_hidden = d_hidden
        self.cell = LSTMCellHandmade(d_in, d_hidden)
        self.head = nn.Linear(d_hidden, n_classes)

    def forward(self, x):
        h = c = x.new_zeros(x.shape[0], self.d_hidden)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return self.head(h)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--clip", action="store_true")
    parser.add_argument("--no-scaler", action="store_true")
    parser.add_argument("--no-autocast", action="store_true")
    args = parser.parse_args()

    model = SeqClassifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    scaler = None if args.no_scaler else torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x = torch.randn(32, 50, 8)
        y = (x[:, :5, 0].sum(1) > 0).long() + 2 * (x[:, :5, 1].sum(1) > 0).long()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=not args.no_autocast):
            loss = F.cross_entropy(model(x), y)
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
