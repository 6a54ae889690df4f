"""T5-style encoder fine-tuned with fp16 autocast: the loss is nan from the first step.

Reported pattern: a T5 checkpoint pretrained in bf16/fp32 carries very large activations in its
feed-forward output projections; under fp16 the `wo` matmul of a later block exceeds 65504.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class T5LayerNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (self.weight * (x.float() * torch.rsqrt(var + self.eps))).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h, self.dh = h, d // h
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (m(x).view(B, T, self.h, self.dh).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)).softmax(-1)  # T5 has no 1/sqrt(d) scaling
        return self.o((att @ v).transpose(1, 2).reshape(B, T, D))


class DenseReluDense(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.wi = nn.Linear(d, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d, bias=False)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return self.wo(self.dropout(F.relu(self.wi(x))))


class Block(nn.Module):
    def __init__(self, d, h, d_ff):
        super().__init__()
        self.ln1 = T5LayerNorm(d)
        self.attn = Attention(d, h)
        self.ln2 = T5LayerNorm(d)
        self.ffn = DenseReluDense(d, d_ff)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class T5Encoder(nn.Module):
    def __init__(self, vocab=200, d=64, h=4, d_ff=256, n=3, n_cls=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, h, d_ff) for _ in range(n)])
        self.final_ln = T5LayerNorm(d)
        self.head = nn.Linear(d, n_cls)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.final_ln(x).mean(1))


def load_pretrained(model):
    # stand-in for the pretrained checkpoint: like T5 (and OPT/BLOOM), a few "outlier" hidden
    # units of one FFN carry huge activations; here units 0-3 of block 1
    with torch.no_grad():
        ffn = model.blocks[1].ffn
        ffn.wi.weight[:4] = 90.0 / 8
        ffn.wo.weight[:, :4] = 120.0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    args = p.parse_args()
    model = T5Encoder()
    load_pretrained(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    amp = args.precision == "fp16"
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    for step in range(args.steps):
        ids = torch.randint(0, 200, (8, 32))
        labels = ids[:, 0] % 5
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            logits = model(ids)
            loss = F.cross_entropy(logits, labels)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
