"""Healthy: a tagger with ignore_index=-100 and logits masked with finfo.min trains in fp16.

Autocast fp16 + GradScaler.  Alarming but harmless: the model fills the logits of tags a token
may not take with torch.finfo(logits.dtype).min, i.e. -65504 in fp16, so the model's output
(module "", tensor "output") sits exactly at the fp16 limit (zero headroom) at every step; padded
positions have target -100 and are ignored by F.cross_entropy (which runs in fp32 under autocast,
so the masked logits give probability 0 and gradient 0, not -inf or NaN).  All module outputs,
losses, gradients and parameters are finite, GradScaler skips no step and the loss goes down.
--plant STEP: at that step every target of the batch is -100 (a batch of padding only), so the
mean over zero counted tokens is 0/0.  First non-finite value then: step STEP, phase forward,
tensor "loss" (NaN, from F.cross_entropy in the training loop, not from a module); the model
output is finite.  Nothing else is: the backward of an all-ignored batch gives finite (zero) loss
gradients, so GradScaler does not skip the step (scale stays 65536); only that step prints nan.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
VOCAB, TAGS, SEQ, DIM = 40, 6, 12, 32


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.mix = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU())
        self.out = nn.Linear(DIM, TAGS)

    def forward(self, tokens, allowed):
        logits = self.out(self.mix(self.embed(tokens)))
        return logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)


def make_batch(batch_size=32, only_padding=False):
    tokens = torch.randint(1, VOCAB, (batch_size, SEQ))
    lengths = torch.randint(4, SEQ + 1, (batch_size, 1))
    pad = torch.arange(SEQ) >= lengths
    tokens = tokens.masked_fill(pad, 0)
    tags = tokens % TAGS
    allowed = F.one_hot(tags, TAGS).bool() | F.one_hot((tokens * 7) % TAGS, TAGS).bool()
    allowed |= F.one_hot((tokens + 1) % TAGS, TAGS).bool()  # 2-3 allowed tags per token
    targets = tags.masked_fill(pad, -100)
    if only_padding:
        targets.fill_(-100)
    return tokens, allowed, targets


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--plant", type=int, default=None, metavar="STEP")
    args = parser.parse_args()

    model = Tagger()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")

    for step in range(args.steps):
        tokens, allowed, targets = make_batch(only_padding=step == args.plant)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens, allowed)
            loss = F.cross_entropy(logits.view(-1, TAGS), targets.view(-1), ignore_index=-100)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
