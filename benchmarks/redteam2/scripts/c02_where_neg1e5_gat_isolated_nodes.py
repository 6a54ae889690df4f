"""Graph attention network (GAT) node classifier in pure fp16 (model.half()), with non-edges
masked as torch.where(adj > 0, e, -1e5) before the neighbour softmax.

-1e5 is finite in float32, where a node without neighbours (isolated node, no self-loop added)
gets a uniform softmax over -1e5 values. In fp16, -1e5 overflows to -inf: isolated nodes' rows
are all -inf and softmax gives 0/0 = NaN, which propagates to the loss at the first step.
(-1e4 or finfo(dtype).min, or adding self-loops, would work; --precision fp32 trains.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class GATLayer(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, bias=False)
        self.a_src = nn.Parameter(torch.randn(d_out) * 0.1)
        self.a_dst = nn.Parameter(torch.randn(d_out) * 0.1)

    def forward(self, x, adj):
        h = self.lin(x)
        e = F.leaky_relu((h @ self.a_dst)[:, None] + (h @ self.a_src)[None, :], 0.2)
        e = torch.where(adj > 0, e, -1e5)
        return torch.softmax(e, -1) @ h


class GAT(nn.Module):
    def __init__(self, d_in=16, hidden=32, n_cls=4):
        super().__init__()
        self.gat1 = GATLayer(d_in, hidden)
        self.gat2 = GATLayer(hidden, n_cls)

    def forward(self, x, adj):
        return self.gat2(F.elu(self.gat1(x, adj)), adj)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    dt = torch.float16 if a.precision == "fp16" else torch.float32
    n = 400
    labels = torch.randint(0, 4, (n,))
    same = labels[:, None] == labels[None, :]
    adj = (torch.rand(n, n) < torch.where(same, 0.02, 0.002)).float()
    adj = ((adj + adj.T) > 0).float()                          # some nodes end up isolated
    x = torch.randn(n, 16) + F.one_hot(labels, 16).float() * 2
    train = torch.rand(n) < 0.6
    model = GAT().to(dt)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(a.steps):
        opt.zero_grad()
        out = model(x.to(dt), adj.to(dt))
        loss = F.cross_entropy(out[train].float(), labels[train])
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")
    print("isolated nodes:", int((adj.sum(1) == 0).sum()))


if __name__ == "__main__":
    main()
