"""Healthy: nn.TransformerEncoder (batch_first) with a bool src_key_padding_mask trains in fp16.

Autocast fp16 + GradScaler.  Alarming but harmless: nn.TransformerEncoder turns the bool padding
mask into a float mask holding -inf and passes it, as a keyword argument, to every
"encoder.layers.N" (input['src_key_padding_mask']) and "encoder.layers.N.self_attn"
(input['key_padding_mask']) at every step; the encoder also returns finite garbage at padded
positions, which "pool" leaves out.  All module outputs, losses, gradients
and parameters are finite, GradScaler skips no step and the loss goes down.
--plant STEP: at that step sample 0 of the batch is padding only (its whole mask row is True).
The attention stays finite (torch 2.13 SDPA returns 0 for a fully masked row); the masked mean
divides by a count of 0.  First non-finite value then: step STEP, phase forward, module "pool"
(MaskedMeanPool), tensor "output" (NaN in row 0, 0/0); everything before it is finite.  Loss and
backward of that step are NaN and GradScaler skips it; later steps are healthy again.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
VOCAB, SEQ, DIM = 20, 12, 32


class MaskedMeanPool(nn.Module):
    def forward(self, x, pad_mask):
        keep = (~pad_mask).unsqueeze(-1).to(x.dtype)
        return (x * keep).sum(1) / keep.sum(1)


class Classifier(nn.Module):
    def __init__(self, n_classes=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=0)
        layer = nn.TransformerEncoderLayer(
            DIM, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.pool = MaskedMeanPool()
        self.head = nn.Linear(DIM, n_classes)

    def forward(self, tokens, pad_mask):
        x = self.encoder(self.embed(tokens), src_key_padding_mask=pad_mask)
        return self.head(self.pool(x, pad_mask))


def make_batch(batch_size=32, all_pad_sample=False):
    tokens = torch.randint(1, VOCAB, (batch_size, SEQ))
    lengths = torch.randint(3, SEQ + 1, (batch_size, 1))
    if all_pad_sample:
        lengths[0] = 0
    pad_mask = torch.arange(SEQ) >= lengths  # True = padding
    tokens = tokens.masked_fill(pad_mask, 0)
    small = ((tokens > 0) & (tokens < VOCAB // 2)).sum(1)
    labels = (2 * small > lengths.squeeze(1)).long()  # majority of "small" tokens?
    return tokens, pad_mask, labels


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--plant", type=int, default=None, metavar="STEP")
    args = parser.parse_args()

    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")

    for step in range(args.steps):
        tokens, pad_mask, labels = make_batch(all_pad_sample=step == args.plant)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(tokens, pad_mask), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
