"""Healthy: an nn.MultiheadAttention block with a boolean local-window attn_mask trains in fp16.

Autocast fp16 + GradScaler.  Alarming but harmless: "attn" (nn.MultiheadAttention, default
need_weights=True, so the plain softmax path) gets a bool attn_mask (keyword argument, True =
blocked) that blocks most keys of every query; MHA turns it into -inf added to the scores, and
the returned attention weights (output[1]) are mostly exact zeros.  All module outputs, losses,
gradients and parameters are finite, GradScaler skips no step and the loss goes down.
--plant STEP: at that step the mask row of query 0 blocks every key (an off-by-one in the window).
First non-finite value then: step STEP, phase forward, module "attn" (nn.MultiheadAttention),
tensor output[0] (NaN at position 0 of every sample: softmax over only -inf; output[1], the
attention weights, is NaN there too); everything before it is finite.  That step's loss and
backward are NaN and GradScaler skips it; later steps are healthy again.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
SEQ, D_IN, DIM = 16, 8, 32


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, DIM)
        self.attn = nn.MultiheadAttention(DIM, num_heads=4, batch_first=True)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 2)

    def forward(self, x, attn_mask):
        h = self.inp(x)
        a, _ = self.attn(h, h, h, attn_mask=attn_mask)
        return self.head(self.norm(h + a))


def window_mask(size=SEQ, radius=1):
    pos = torch.arange(size)
    return (pos[:, None] - pos[None, :]).abs() > radius  # True = may not attend


def make_batch(batch_size=32):
    x = torch.randn(batch_size, SEQ, D_IN)
    f = F.pad(x[..., 0], (1, 1))
    labels = (f[:, :-2] + f[:, 2:] > 0).long()  # depends on the two neighbours
    return x, labels


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--plant", type=int, default=None, metavar="STEP")
    args = parser.parse_args()

    model = Tagger()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    scaler = torch.amp.GradScaler("cpu")

    for step in range(args.steps):
        x, labels = make_batch()
        mask = window_mask()
        if step == args.plant:
            mask[0, :] = True
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x, mask)
            loss = F.cross_entropy(logits.reshape(-1, 2), labels.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
