"""Graph convolutional network (dense normalised adjacency, node classification) converted to
fp16 with model.half() and trained with Adam (eps=1e-8).

Adam's second moment is (1 - beta2) * g^2 = 1e-3 * g^2 in the parameter's dtype: in fp16 it
underflows to 0 for every |g| < ~8e-3 and eps=1e-8 is 0 as well, so the update
m_hat / (sqrt(v_hat) + eps) = m / 0 = inf is written into the weights at the first step. The
loss is NaN from the second step. --precision fp32 trains.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class GCN(nn.Module):
    def __init__(self, d_in=32, hidden=64, n_cls=5):
        super().__init__()
        self.lin1 = nn.Linear(d_in, hidden)
        self.lin2 = nn.Linear(hidden, hidden)
        self.cls = nn.Linear(hidden, n_cls)

    def forward(self, x, a_hat):
        h = F.relu(a_hat @ self.lin1(x))
        h = F.relu(a_hat @ self.lin2(h))
        return self.cls(h)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    dt = torch.float16 if a.precision == "fp16" else torch.float32
    n = 600
    labels = torch.randint(0, 5, (n,))
    same = labels[:, None] == labels[None, :]
    adj = (torch.rand(n, n) < torch.where(same, 0.03, 0.003)).float()
    adj = ((adj + adj.T) > 0).float() + torch.eye(n)
    dinv = adj.sum(1).rsqrt()
    a_hat = dinv[:, None] * adj * dinv[None, :]
    x = torch.randn(n, 32) + F.one_hot(labels, 32).float()
    train = torch.rand(n) < 0.5
    model = GCN().to(dt)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(a.steps):
        opt.zero_grad()
        logits = model(x.to(dt), a_hat.to(dt))
        loss = F.cross_entropy(logits[train].float(), labels[train])
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
