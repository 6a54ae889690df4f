"""Fails: a hand-written RMSNorm with eps=1e-12 in a float16 (.half()) transformer.

eps=1e-12 is below float16's smallest subnormal (2**-24 ~ 5.96e-8), so `ms + self.eps` adds 0.
Padding tokens use Embedding(padding_idx=0), whose row is exactly zero: their mean square is 0,
rsqrt(0 + 0) is inf and x * inf = 0 * inf = NaN in the first RMSNorm, at step 0.
--fixed uses eps=1e-5 (a float16 subnormal, not zero): trains. --fixed fp32norm keeps eps=1e-12
but computes the norm in float32 (as torch's own nn.RMSNorm kernels do internally).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-12, fp32=False):
        super().__init__()
        self.eps = eps
        self.fp32 = fp32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float() if self.fp32 else x
        ms = h.pow(2).mean(-1, keepdim=True)
        return (h * torch.rsqrt(ms + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, d, eps, fp32):
        super().__init__()
        self.norm1 = RMSNorm(d, eps, fp32)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.norm2 = RMSNorm(d, eps, fp32)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=32, eps=1e-12, fp32=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.blocks = nn.ModuleList([Block(d, eps, fp32) for _ in range(2)])
        self.norm = RMSNorm(d, eps, fp32)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fixed", choices=["eps", "fp32norm"])
    args = parser.parse_args()

    eps = 1e-5 if args.fixed == "eps" else 1e-12
    model = TinyLM(eps=eps, fp32=args.fixed == "fp32norm").half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randint(1, 64, (32, 13))
    data[:, 9:] = 0  # right padding

    for step in range(args.steps):
        batch = data[(step * 8) % 32:(step * 8) % 32 + 8]
        optimizer.zero_grad()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 64), batch[:, 1:].reshape(-1),
                               ignore_index=0)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
