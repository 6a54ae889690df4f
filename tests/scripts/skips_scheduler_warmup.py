"""Fails quietly: GradScaler skips the first steps while a warm-up LR scheduler advances on them,
so the warm-up is spent on updates that never happened.

Autocast fp16 + GradScaler(init_scale=2**24), AdamW, LambdaLR linear warm-up over 8 steps,
scheduler.step() every iteration.  A small transformer encoder classifies token sequences.  At
scale 2**24 the scaled gradients overflow fp16, so GradScaler skips steps 0..k and halves the
scale each time; the scheduler steps anyway (torch warns "Detected call of lr_scheduler.step()
before optimizer.step()"), and the first update that is applied already runs at a learning rate
well into the warm-up.  ``--correct`` uses GradScaler's default init_scale and steps the scheduler
only when the optimizer stepped (the healthy control: at most a calibration skip or two).
Expected: no non-finite value that is not a skipped step; phase loss_scaling, kind loss_scale:
the LR scheduler advanced on skipped steps; the fix is an init_scale from the gradients'
exponents (or stepping the scheduler only after applied steps).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class TinyEncoder(nn.Module):
    def __init__(self, vocab=50, d=32, n_classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True), 2,
            enable_nested_tensor=False)
        self.head = nn.Linear(d, n_classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--correct", action="store_true")
    args = parser.parse_args()

    model = TinyEncoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warmup = 8
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16 if args.correct else 2.0**24)
    for step in range(args.steps):
        tokens = torch.randint(0, 50, (16, 12))
        y = tokens[:, 0] % 3
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(tokens), y)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if not args.correct or scaler.get_scale() >= scale:  # skipped steps lower the scale
            scheduler.step()
        print(f"step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}")


if __name__ == "__main__":
    main()
