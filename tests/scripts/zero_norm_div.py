"""Fails: an L2 normalisation divides by a norm that is 0 for an all-zero embedding (0/0 = NaN).

A cosine classifier: "encoder" (Linear without bias, ReLU) -> "head.normalize" computes
x / x.norm(dim=-1, keepdim=True) -> "head.classifier". At step 2 the batch holds an empty record
(an all-zero row), whose embedding is exactly 0: the division gives 0/0 = NaN in the forward of
step 2, module head.normalize, and the loss is NaN. Autocast fp16 + GradScaler.
Fix: floor the norm (x / x.norm(...).clamp_min(eps)); a floor of 1e-6 trains.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class L2Normalize(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


class CosineHead(nn.Module):
    def __init__(self, d, n_classes):
        super().__init__()
        self.normalize = L2Normalize()
        self.classifier = nn.Linear(d, n_classes, bias=False)

    def forward(self, x):
        return 10.0 * self.classifier(self.normalize(x))


class Net(nn.Module):
    def __init__(self, d_in=16, d=32, n_classes=4):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, d, bias=False), nn.ReLU())
        self.head = CosineHead(d, n_classes)

    def forward(self, x):
        return self.head(self.encoder(x))


def make_batch(step, batch_size=16, d_in=16):
    x = torch.randn(batch_size, d_in)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    if step in (2, 5):
        x[3] = 0.0  # an empty record
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x, y = make_batch(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
