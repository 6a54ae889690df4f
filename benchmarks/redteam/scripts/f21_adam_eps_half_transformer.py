"""Tiny transformer trained fully in half precision (model.half()) with AdamW's default eps.

Reported pattern: "nan after the first optimizer step with model.half()". AdamW keeps its
state in the parameters' dtype; eps=1e-8 is below float16's smallest subnormal (6e-8) and
rounds to 0, and (1 - beta2) * g^2 flushes to 0 for gradients below ~5e-3, so
exp_avg / (sqrt(exp_avg_sq) + eps) divides by zero: the update is inf or nan (0/0 for
parameters whose gradient is exactly 0). (eps=1e-4, or fp32 weights with autocast, fixes it.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Classifier(nn.Module):
    def __init__(self, vocab=800, d=64, n_cls=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d, n_cls)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--eps", type=float, default=1e-8)
    args = p.parse_args()
    model = Classifier().half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=args.eps)
    for step in range(args.steps):
        ids = torch.randint(0, 800, (16, 20))
        y = ids[:, 0] % 3
        opt.zero_grad()
        loss = F.cross_entropy(model(ids).float(), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
