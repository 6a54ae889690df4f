"""Crashes: scaler.update() is only called at the end of each epoch, scaler.step() every batch.

A small transformer classifier with autocast (float16) and GradScaler. The second batch's
scaler.step(optimizer) raises "RuntimeError: step() has already been called since the last
update()." --fixed calls scaler.update() after every scaler.step(optimizer).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Classifier(nn.Module):
    def __init__(self, vocab=100, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(d, 2)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--fixed", action="store_true")
    args = parser.parse_args()

    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    tokens, labels = torch.randint(0, 100, (64, 12)), torch.randint(0, 2, (64,))

    step = 0
    for _epoch in range(args.epochs):
        for i in range(0, 64, 16):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(tokens[i:i + 16])
            loss = F.cross_entropy(logits.float(), labels[i:i + 16])
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            if args.fixed:
                scaler.update()
            print(f"step {step} loss {loss.item():.4f}")
            step += 1
        if not args.fixed:
            scaler.update()


if __name__ == "__main__":
    main()
