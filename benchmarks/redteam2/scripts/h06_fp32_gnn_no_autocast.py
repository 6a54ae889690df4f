"""HEALTHY: graph convolutional network in plain float32 (no autocast, no GradScaler), Adam with
eps=1e-8 (fine in fp32), isolated nodes and all. Nothing to report.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class GCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(32, 64)
        self.l2 = nn.Linear(64, 5)

    def forward(self, x, a_hat):
        return a_hat @ self.l2(F.relu(a_hat @ self.l1(x)))


def main():
    n = 500
    labels = torch.randint(0, 5, (n,))
    same = labels[:, None] == labels[None, :]
    adj = (torch.rand(n, n) < torch.where(same, 0.03, 0.003)).float()
    adj = ((adj + adj.T) > 0).float() + torch.eye(n)
    dinv = adj.sum(1).rsqrt()
    a_hat = dinv[:, None] * adj * dinv[None, :]
    x = torch.randn(n, 32) + F.one_hot(labels, 32).float()
    train = torch.rand(n) < 0.5
    model = GCN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-8)
    for step in range(20):
        opt.zero_grad()
        loss = F.cross_entropy(model(x, a_hat)[train], labels[train])
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
