"""BERT-style encoder in pure fp16 (model.half()) with the old hand-written BertLayerNorm
(eps=1e-12, BERT's default) applied to embeddings whose padded positions were zeroed.

Reported pattern: "nan in the first forward with .half(), fine in fp32". For a padded
(all-zero) row the variance is exactly 0; in float16 `s + 1e-12` is still 0 (1e-12 is far below
float16's smallest subnormal, 6e-8), so (x - u) / sqrt(0) = 0/0 = nan. In float32 the same row
gives 0 / 1e-6 = 0. (eps >= 1e-5, or nn.LayerNorm, fixes it.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class BertLayerNorm(nn.Module):
    """The pre-apex fallback from pytorch-pretrained-bert."""

    def __init__(self, hidden_size, eps=1e-12):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


class Embeddings(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        self.word = nn.Embedding(vocab, d, padding_idx=0)
        self.position = nn.Embedding(64, d)
        self.LayerNorm = BertLayerNorm(d)

    def forward(self, ids):
        mask = (ids != 0).to(self.word.weight.dtype)[..., None]
        x = (self.word(ids) + self.position(torch.arange(ids.shape[1]))) * mask
        return self.LayerNorm(x)


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.attn_norm = BertLayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ffn_norm = BertLayerNorm(d)

    def forward(self, x, pad):
        x = self.attn_norm(x + self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0])
        return self.ffn_norm(x + self.ffn(x))


class Bert(nn.Module):
    def __init__(self, vocab=1000, d=64, n_cls=2):
        super().__init__()
        self.embeddings = Embeddings(vocab, d)
        self.layers = nn.ModuleList([Layer(d) for _ in range(2)])
        self.classifier = nn.Linear(d, n_cls)

    def forward(self, ids):
        pad = ids == 0
        x = self.embeddings(ids)
        for layer in self.layers:
            x = layer(x, pad)
        return self.classifier(x[:, 0])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    args = p.parse_args()
    model = Bert()
    if args.precision == "fp16":
        model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        ids = torch.randint(1, 1000, (8, 32))
        lens = torch.randint(12, 33, (8,))
        ids[torch.arange(32)[None] >= lens[:, None]] = 0
        y = ids[:, 1] % 2
        opt.zero_grad()
        loss = F.cross_entropy(model(ids).float(), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
