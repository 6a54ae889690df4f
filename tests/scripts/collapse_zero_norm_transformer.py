"""Fails: a sentence-embedding transformer L2-normalises its pooled output by a hand-written norm;
padding-only rows pool to an exact zero vector, whose norm has a NaN derivative, so every backward
is NaN, GradScaler skips every step and the loss scale collapses.

Autocast fp16 + GradScaler, AdamW.  "normalize" (L2Normalize) computes
x / (x.pow(2).sum(-1, keepdim=True).sqrt() + 1e-6): the eps keeps the forward finite (0 / 1e-6 =
0), but the backward of sqrt at 0 is 1 / (2 * 0) = inf, and inf * 0 = NaN.  Each batch ends with
two sequences that are padding only; the masked mean pool gives them an all-zero embedding.
The forward and the loss stay finite.
Expected first non-finite value: step 0, phase backward, module "normalize", grad_input[0] (NaN);
GradScaler skips every step.  Diagnosis: kind nan_op, module "normalize", the sqrt's backward
(aten.div / aten.sqrt), the source line of the norm.  Fix: eps inside the sqrt, or
F.normalize(x, dim=-1) (whose backward is finite at 0).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class L2Normalize(nn.Module):
    def forward(self, x):
        return x / (x.pow(2).sum(-1, keepdim=True).sqrt() + 1e-6)


class SentenceEncoder(nn.Module):
    def __init__(self, vocab=60, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True), 2,
            enable_nested_tensor=False)
        self.normalize = L2Normalize()

    def forward(self, tokens):
        keep = (tokens != 0).unsqueeze(-1).float()
        h = self.encoder(self.embed(tokens)) * keep
        pooled = h.sum(1) / keep.sum(1).clamp_min(1.0)
        return self.normalize(pooled)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    model = SentenceEncoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        tokens = torch.randint(1, 60, (16, 10))
        tokens[-2:] = 0  # padding-only sequences
        labels = tokens[:, 0] % 4
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            emb = model(tokens)
            sim = emb @ emb.t() / 0.1
        loss = F.cross_entropy(sim.float(), torch.arange(16)) + 0.0 * labels.sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
