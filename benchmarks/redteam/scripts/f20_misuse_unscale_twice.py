"""Transformer fine-tuning with fp16 autocast + GradScaler that calls scaler.unscale_ twice.

Reported pattern: a logging helper unscales the gradients to report their norm, and the
clipping code a few lines later unscales again before clip_grad_norm_. torch raises
"unscale_() has already been called on this optimizer since the last update()" at the first
step; the fix is one unscale_ per step, before both.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def log_grad_norm(model, optimizer, scaler):
    scaler.unscale_(optimizer)  # so that the logged norm is the true one
    norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]
    return torch.stack(norms).norm().item()


class Model(nn.Module):
    def __init__(self, vocab=1000, d=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids))[:, 0])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        ids = torch.randint(0, 1000, (16, 24))
        y = (ids[:, 1] > 500).long()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(ids), y)
        scaler.scale(loss).backward()
        gnorm = log_grad_norm(model, optimizer, scaler)
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} grad_norm {gnorm:.3f}")


if __name__ == "__main__":
    main()
