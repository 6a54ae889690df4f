"""A GPT-style language model (token + position embeddings, causal pre-LN blocks, lm_head) on a
synthetic next-token task; see curves_common.py for the flags that make it fail without NaN."""

import torch
from curves_common import Trunk, parse, train
from torch import nn

V, T, D = 32, 16, 32


class GPT(nn.Module):
    def __init__(self, args) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        self.trunk = Trunk(D, 2, args.depth, True, args.post_ln, args.qk_norm)
        self.lm_head = nn.Linear(D, V)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.lm_head(self.trunk(x))


def batch(step, g):
    # each sequence counts up by a stride of its own: the next token is predictable from context
    start = torch.randint(0, V, (16, 1), generator=g)
    stride = torch.randint(1, 4, (16, 1), generator=g)
    seq = (start + stride * torch.arange(T + 1)) % V
    return seq[:, :-1], seq[:, 1:]


if __name__ == "__main__":
    args = parse()
    torch.manual_seed(args.seed)
    train(args, GPT(args), batch)
