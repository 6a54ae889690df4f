"""Fails like zero_norm_div.py (an L2 normalisation of an all-zero embedding at step 2), and
writes a checkpoint and a log line every step, as training scripts do: ckpt.pt (torch.save)
and train.log, in the working directory."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class L2Normalize(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), L2Normalize(),
                          nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        x = torch.randn(16, 16)
        y = (x[:, 0] > 0).long()
        if step == 2:
            x[3] = 0.0
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        torch.save({"step": step, "model": model.state_dict()}, "ckpt.pt")
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
