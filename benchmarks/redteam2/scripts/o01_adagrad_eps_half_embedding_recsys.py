"""Click-through-rate model (embedding tables + MLP) converted to pure fp16 with model.half() and
trained with Adagrad (default eps=1e-10), the classic recommender optimiser.

In fp16, eps=1e-10 rounds to exactly 0. Adagrad divides by sqrt(state_sum) + eps; every embedding
row that was not in the batch has a zero gradient and a zero state_sum, so its update is
0 / (0 + 0) = NaN and the optimiser writes NaN into most of the item table at the first step.
The next forward reads NaN rows and the loss is NaN. (fp32 master weights, or eps >= 1e-4 in
fp16, train; --precision fp32 trains.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class CTRModel(nn.Module):
    def __init__(self, n_items=3000, n_ctx=50, d=32):
        super().__init__()
        self.item = nn.Embedding(n_items, d)
        self.ctx = nn.Embedding(n_ctx, d)
        self.mlp = nn.Sequential(nn.Linear(2 * d, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, item, ctx):
        return self.mlp(torch.cat([self.item(item), self.ctx(ctx)], -1)).squeeze(-1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    dt = torch.float16 if a.precision == "fp16" else torch.float32
    model = CTRModel().to(dt)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    items = torch.randint(0, 3000, (50000,))
    ctx = torch.randint(0, 50, (50000,))
    click = (torch.rand(50000) < torch.sigmoid((items % 10 - 5).float() * 0.5 + (ctx % 3 - 1))).float()
    for step in range(a.steps):
        idx = torch.randint(0, 50000, (256,))
        opt.zero_grad()
        logit = model(items[idx], ctx[idx])
        loss = F.binary_cross_entropy_with_logits(logit.float(), click[idx])
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
