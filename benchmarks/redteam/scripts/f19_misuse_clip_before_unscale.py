"""GRU tagger with fp16 autocast + GradScaler, gradients clipped *before* scaler.unscale_.

Reported pattern: "with AMP the model stopped learning". clip_grad_norm_(..., 1.0) runs on the
scaled gradients (norm ~ 65536 x the true one), so it shrinks them by ~1e4-1e5; scaler.step()
then divides by the scale again. Every update is ~1/65536 of what it should be; nothing is
non-finite and the loss just stays where it started. (scaler.unscale_(optimizer) before
clipping fixes it: --fixed.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Tagger(nn.Module):
    def __init__(self, vocab=500, d=64, n_tags=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.gru = nn.GRU(d, d, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * d, n_tags)

    def forward(self, ids):
        h, _ = self.gru(self.embed(ids))
        return self.out(h)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--fixed", action="store_true")
    args = p.parse_args()
    model = Tagger()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        ids = torch.randint(0, 500, (16, 30))
        tags = ids % 8
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, 8), tags.reshape(-1))
        scaler.scale(loss).backward()
        if args.fixed:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
