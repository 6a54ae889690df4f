"""Fails: a hand-written (BERT-style) LayerNorm with eps=1e-12 in a float16 (.half()) CNN.

The CNN normalises each sample's feature vector with
`(x - mean) / torch.sqrt(var + self.variance_epsilon)`, variance_epsilon=1e-12, which is 0 in
float16 (smallest subnormal 2**-24 ~ 5.96e-8). The data set holds blank (all-zero) images: after
the ReLU and pooling their features are one constant, the variance is exactly 0 and the norm
computes 0 / sqrt(0 + 0) = 0 / 0 = NaN, at step 0.
--fixed uses variance_epsilon=1e-5: trains.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class BertLayerNorm(nn.Module):
    def __init__(self, hidden, eps=1e-12):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


class Net(nn.Module):
    def __init__(self, eps=1e-12):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.norm = BertLayerNorm(16 * 4 * 4, eps)
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(self.norm(x.flatten(1)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fixed", choices=["eps"])
    args = parser.parse_args()

    eps = 1e-5 if args.fixed == "eps" else 1e-12
    model = Net(eps).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    images, labels = torch.rand(64, 1, 16, 16), torch.randint(0, 10, (64,))
    images[::8] = 0  # blank frames in the data set

    for step in range(args.steps):
        idx = torch.arange(step * 16, (step + 1) * 16) % 64
        optimizer.zero_grad()
        logits = model(images[idx].half())
        loss = F.cross_entropy(logits.float(), labels[idx])
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
