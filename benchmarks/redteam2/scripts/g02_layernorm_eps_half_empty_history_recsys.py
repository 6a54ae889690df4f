"""Sequential recommender: the user tower mean-pools the embeddings of the user's recent items
(nn.EmbeddingBag) and applies a hand-written LayerNorm with eps=1e-12; the model runs in pure
fp16 (model.half()), optimiser SGD.

Cold-start users have an empty history: EmbeddingBag returns an all-zero vector for an empty
bag, the LayerNorm's variance is exactly 0 and eps=1e-12 rounds to 0 in fp16, so
(x - mean) / sqrt(var + eps) = 0 / 0 = NaN in the user tower's norm; the loss is NaN at the
first step. --precision fp32 trains.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class LayerNorm(nn.Module):
    def __init__(self, d, eps=1e-12):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return self.weight * (x - u) / torch.sqrt(s + self.eps) + self.bias


class Recommender(nn.Module):
    def __init__(self, n_items=4000, d=32):
        super().__init__()
        self.history = nn.EmbeddingBag(n_items, d, mode="mean")
        self.user_norm = LayerNorm(d)
        self.user_mlp = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, d))
        self.item = nn.Embedding(n_items, d)

    def forward(self, hist, offsets, cand):
        u = self.user_mlp(self.user_norm(self.history(hist, offsets)))
        return (u * self.item(cand)).sum(-1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    dt = torch.float16 if a.precision == "fp16" else torch.float32
    model = Recommender().to(dt)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(a.steps):
        lens = torch.randint(0, 6, (128,))                  # 0 = cold-start user
        hist = torch.randint(0, 4000, (int(lens.sum()),))
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
        cand = torch.randint(0, 4000, (128,))
        label = (cand % 4 == 0).float()
        opt.zero_grad()
        logit = model(hist, offsets, cand)
        loss = F.binary_cross_entropy_with_logits(logit.float(), label)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
