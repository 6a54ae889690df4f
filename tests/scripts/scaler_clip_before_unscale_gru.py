"""Broken: gradients are clipped before scaler.unscale_(), so clipping sees scaled gradients.

A GRU language model with autocast (float16) and GradScaler. clip_grad_norm_(max_norm=1.0) runs
on gradients still multiplied by the loss scale (65536), so their norm is ~65536 times too large
and every step is clipped to a tiny update: nothing turns NaN, the model just does not learn.
--fixed calls scaler.unscale_(optimizer) before clipping (the correct order).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class LM(nn.Module):
    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, tokens):
        h, _ = self.rnn(self.embed(tokens))
        return self.out(h)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fixed", action="store_true")
    args = parser.parse_args()

    model = LM()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    data = torch.randint(0, 50, (64, 17))

    for step in range(args.steps):
        batch = data[(step * 16) % 64:(step * 16) % 64 + 16]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 50), batch[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        if args.fixed:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
