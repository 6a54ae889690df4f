"""Crashes: a .half() point-cloud CNN pads its distance matrix with torch.full(..., 1e5).

The model keeps k-nearest-neighbour features: it pads the pairwise distances of a variable
number of points with a large constant so that padding is never picked. In float16 (model.half())
1e5 is beyond the format's max (65504) and torch.full raises "RuntimeError: value cannot be
converted to type c10::Half without overflow" in the model's forward at step 0.
--fixed pads with torch.finfo(dist.dtype).max: trains.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
FIXED = False


class KNNFeatures(nn.Module):
    def __init__(self, k=4, max_points=24):
        super().__init__()
        self.k = k
        self.max_points = max_points

    def forward(self, points):
        dist = (points.unsqueeze(2) - points.unsqueeze(1)).pow(2).sum(-1)
        pad = self.max_points - dist.shape[-1]
        big = torch.finfo(dist.dtype).max if FIXED else 1e5
        filler = torch.full((*dist.shape[:-1], pad), big, dtype=dist.dtype, device=dist.device)
        dist = torch.cat([dist, filler], dim=-1)
        idx = dist.topk(self.k, largest=False).indices.clamp_max(points.shape[1] - 1)
        neighbours = torch.gather(points.unsqueeze(1).expand(-1, points.shape[1], -1, -1), 2,
                                  idx.unsqueeze(-1).expand(-1, -1, -1, points.shape[-1]))
        return (neighbours - points.unsqueeze(2)).flatten(2)


class PointNet(nn.Module):
    def __init__(self, k=4):
        super().__init__()
        self.knn = KNNFeatures(k)
        self.conv = nn.Conv1d(3 * k, 32, 1)
        self.head = nn.Linear(32, 5)

    def forward(self, points):
        f = self.knn(points).transpose(1, 2)
        return self.head(F.relu(self.conv(f)).amax(-1))


def main():
    global FIXED
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fixed", action="store_true")
    args = parser.parse_args()
    FIXED = args.fixed

    model = PointNet().half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    clouds, labels = torch.randn(32, 16, 3), torch.randint(0, 5, (32,))

    for step in range(args.steps):
        idx = torch.arange(step * 8, (step + 1) * 8) % 32
        optimizer.zero_grad()
        logits = model(clouds[idx].half())
        loss = F.cross_entropy(logits.float(), labels[idx])
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
