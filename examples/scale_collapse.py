"""Fails: every backward is NaN whatever the scale, so GradScaler skips every step forever.

Autocast fp16 + GradScaler.  "pdist" computes pairwise distances by hand,
torch.sqrt(((z[:, None] - z[None]) ** 2).sum(-1)), whose diagonal is exactly sqrt(0) = 0: finite
in the forward, but its gradient there is 0 / (2 * 0) = NaN in every backward.  GradScaler treats
it as an overflow: it skips the step and halves the scale, every step, forever.
Expected first non-finite value:
  step 0 (0-based), phase backward, module "pdist" (PairwiseDistance), tensor grad_input[0]
  (NaN; its grad_output[0] is finite); the same at every later step.  The NaN is made in the
  backward; as GradScaler then skips the step, a tool may file it under loss_scaling.
All forwards and losses are finite.  No optimizer step is ever applied: the scale goes
65536 -> 32768 -> ... -> 65536 / 2**30 (~6.1e-05) after the default 30 steps (each line prints
the scale after that step's update), and the loss never improves.
Fix: add eps inside the sqrt (or use torch.cdist / F.pairwise_distance, or mask the diagonal
before the sqrt).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class PairwiseDistance(nn.Module):
    def forward(self, z):
        return torch.sqrt(((z[:, None] - z[None]) ** 2).sum(-1))


class Embedder(nn.Module):
    def __init__(self, d_in=16, d_hidden=32, d_out=8):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_out)
        )
        self.pdist = PairwiseDistance()

    def forward(self, x):
        return self.pdist(self.encoder(x))


def contrastive_loss(dist, labels, margin=1.0):
    same = (labels[:, None] == labels[None]).float()
    return (same * dist**2 + (1 - same) * F.relu(margin - dist) ** 2).mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    model = Embedder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    centers = torch.randn(4, 16)

    for step in range(args.steps):
        labels = torch.randint(0, 4, (32,))
        x = centers[labels] + 0.3 * torch.randn(32, 16)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            dist = model(x)
        loss = contrastive_loss(dist.float(), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
