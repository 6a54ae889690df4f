"""Fails only the first time it runs: a zero record at step 2 while a marker file is absent.

A cosine classifier (as zero_norm_div.py): x / x.norm() of an all-zero embedding is 0/0 = NaN in
the forward of step 2, module head.normalize. The script writes the marker (``--marker PATH``)
as it starts; every later run finds it, gets no zero record and trains. A re-run of this script
cannot reproduce the first run's failure: state outside the script (a cache, a download, a
first-epoch shuffle) decided it. Autocast fp16 + GradScaler on CPU.
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class L2Normalize(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


class Net(nn.Module):
    def __init__(self, d_in=16, d=32, n_classes=4):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, d, bias=False), nn.ReLU())
        self.normalize = L2Normalize()
        self.classifier = nn.Linear(d, n_classes, bias=False)

    def forward(self, x):
        return 10.0 * self.classifier(self.normalize(self.encoder(x)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--marker", required=True)
    args = parser.parse_args()

    first_run = not os.path.exists(args.marker)
    with open(args.marker, "w") as f:
        f.write("ran\n")
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x = torch.randn(16, 16)
        y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        if first_run and step == 2:
            x[3] = 0.0  # an empty record, only in the first run
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
