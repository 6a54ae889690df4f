"""Crashes: a hand-written attention masks padding with masked_fill(mask, -1e9) under autocast.

The scores come out of a float16 matmul (autocast), and -1e9 is far beyond float16's range
(+/-65504): torch raises "RuntimeError: value cannot be converted to type c10::Half without
overflow" in the attention's forward at step 0. The line is in the user's model.
--fixed uses torch.finfo(scores.dtype).min: trains.
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
FIXED = False


class SelfAttention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if FIXED:
            scores = scores.masked_fill(pad[:, None, :], torch.finfo(scores.dtype).min)
        else:
            scores = scores.masked_fill(pad[:, None, :], -1e9)
        return self.out(F.softmax(scores, dim=-1) @ v)


class Classifier(nn.Module):
    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.attn = SelfAttention(d)
        self.head = nn.Linear(d, 2)

    def forward(self, tokens):
        pad = tokens == 0
        h = self.attn(self.embed(tokens), pad)
        return self.head(h.mean(1))


def main():
    global FIXED
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fixed", action="store_true")
    args = parser.parse_args()
    FIXED = args.fixed

    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    tokens = torch.randint(1, 50, (64, 10))
    tokens[:, 7:] = 0
    labels = torch.randint(0, 2, (64,))

    for step in range(args.steps):
        idx = torch.arange(step * 16, (step + 1) * 16) % 64
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens[idx])
        loss = F.cross_entropy(logits.float(), labels[idx])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
