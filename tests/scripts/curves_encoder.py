"""A bidirectional transformer encoder classifier (token embeddings, non-causal blocks, mean
pooling, a head): does a sequence hold more high tokens than low ones; see curves_common.py for
the flags that make it fail without NaN."""

import torch
from curves_common import Trunk, parse, train
from torch import nn

V, T, D = 16, 12, 32


class Encoder(nn.Module):
    def __init__(self, args) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(1, T, D) * 0.02)
        self.trunk = Trunk(D, 2, args.depth, False, args.post_ln, args.qk_norm)
        self.head = nn.Linear(D, 2)

    def forward(self, idx):
        return self.head(self.trunk(self.tok(idx) + self.pos).mean(1))


def batch(step, g):
    idx = torch.randint(0, V, (32, T), generator=g)
    return idx, ((idx >= V // 2).sum(1) * 2 > T).long()


if __name__ == "__main__":
    args = parse()
    torch.manual_seed(args.seed)
    train(args, Encoder(args), batch)
