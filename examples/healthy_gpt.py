"""Healthy: a tiny GPT (-inf causal mask, SDPA is_causal, ignore_index padding) trains in fp16.

Autocast fp16 + GradScaler.  Alarming but harmless: blocks.0.attn adds a causal mask made with
torch.full(..., float("-inf")).triu(1) to its scores, and that mask is passed to every block, so
"blocks.0" / "blocks.1" / "blocks.0.attn" / "blocks.1.attn" see -inf in their input[1] at every
step; blocks.1.attn uses F.scaled_dot_product_attention(is_causal=True) instead; padded positions
have target -100 (ignore_index).  All module outputs, losses, gradients and parameters are
finite, GradScaler skips no step and the loss goes down.
--plant STEP: at the start of that step blocks.1.mlp.fc.weight is multiplied by 1e5 (a simulated
weight blow-up).  First non-finite value then: step STEP, phase forward, module "blocks.1.mlp.fc"
(nn.Linear), tensor "output" (+/-inf, fp16 overflow); everything before it is finite (apart from
the -inf mask inputs above).  GradScaler then skips that step and every later one.
"""

import argparse
import math
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
VOCAB, SEQ, DIM, HEADS = 32, 16, 32, 2


class ManualAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def split(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        b, t, _ = x.shape
        return [y.view(b, t, HEADS, DIM // HEADS).transpose(1, 2) for y in (q, k, v)]

    def attend(self, q, k, v, mask):
        scores = q @ k.transpose(-2, -1) / math.sqrt(DIM // HEADS) + mask
        return scores.softmax(dim=-1) @ v

    def forward(self, x, mask):
        out = self.attend(*self.split(x), mask)
        return self.proj(out.transpose(1, 2).reshape(x.shape))


class SDPAAttention(ManualAttention):
    def attend(self, q, k, v, mask):  # mask unused: is_causal builds the same one
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(DIM), attn
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(
            OrderedDict(fc=nn.Linear(DIM, 4 * DIM), act=nn.GELU(), proj=nn.Linear(4 * DIM, DIM))
        )

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.pos_emb = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList([Block(ManualAttention()), Block(SDPAAttention())])
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t))
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


def make_batch(batch_size=16):
    start = torch.randint(1, VOCAB, (batch_size, 1))
    stride = torch.randint(1, 4, (batch_size, 1))
    tokens = 1 + (start + stride * torch.arange(SEQ + 1)) % (VOCAB - 1)  # learnable sequences
    lengths = torch.randint(SEQ // 2, SEQ + 1, (batch_size, 1))
    pad = torch.arange(SEQ + 1) > lengths
    tokens = tokens.masked_fill(pad, 0)
    targets = tokens[:, 1:].masked_fill(pad[:, 1:], -100)  # no loss on padding
    return tokens[:, :-1], targets


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--plant", type=int, default=None, metavar="STEP")
    args = parser.parse_args()

    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")

    for step in range(args.steps):
        if step == args.plant:
            with torch.no_grad():
                model.blocks[1].mlp.fc.weight.mul_(1e5)
        idx, targets = make_batch()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(idx)
            loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-100)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
