"""ColBERT-style late-interaction retriever (tiny transformer), fp16 autocast + GradScaler:
the loss scale falls every step and nothing trains.

Reported pattern: token embeddings are L2-normalised by hand,
x / x.pow(2).sum(-1, keepdim=True).sqrt().clamp(min=1e-6), *after* padded positions were
zeroed by the attention mask. The clamp keeps the forward finite, but clamp passes a zero
gradient to sqrt(0), whose backward is 0 / (2 * 0) = NaN on every padded token of every
batch. GradScaler skips every step. (F.normalize, or normalising before masking, fixes it.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
PAD = 0


class L2Norm(nn.Module):
    def forward(self, x):
        return x / x.pow(2).sum(-1, keepdim=True).sqrt().clamp(min=1e-6)


class Encoder(nn.Module):
    def __init__(self, vocab=2000, d=64, out=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        layer = nn.TransformerEncoderLayer(d, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.proj = nn.Linear(d, out, bias=False)
        self.norm = L2Norm()

    def forward(self, ids):
        pad = ids == PAD
        h = self.encoder(self.embed(ids), src_key_padding_mask=pad)
        h = self.proj(h) * (~pad)[..., None]  # zero the padded tokens
        return self.norm(h), pad


def maxsim(q, d, d_pad):
    s = torch.einsum("qid,kjd->qkij", q, d)  # every query against every doc in the batch
    s = s.masked_fill(d_pad[None, :, None, :], -1e4)
    return s.max(-1).values.sum(-1)


def batch(bs=8, lq=12, ld=24, vocab=2000):
    q = torch.randint(1, vocab, (bs, lq))
    d = torch.randint(1, vocab, (bs, ld))
    d[:, :6] = q[:, :6]  # the relevant doc shares terms with the query
    qlen = torch.randint(6, lq + 1, (bs,))
    dlen = torch.randint(10, ld + 1, (bs,))
    q[torch.arange(lq)[None] >= qlen[:, None]] = PAD
    d[torch.arange(ld)[None] >= dlen[:, None]] = PAD
    return q, d


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    model = Encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        q_ids, d_ids = batch()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            q, _ = model(q_ids)
            d, d_pad = model(d_ids)
            scores = maxsim(q, d, d_pad)
        loss = F.cross_entropy(scores.float(), torch.arange(len(q_ids)))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
