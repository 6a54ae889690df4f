"""Fails: tabular features in the thousands fed to an MLP under float16 autocast.

A credit-risk style classifier takes raw columns (annual income 20000-150000, loan amount
1000-40000, credit limit 500-50000, age, months employed) without standardising them. The first
Linear runs in float16: its sums (and incomes above 65504) overflow float16 at step 0.
--normalize standardises each column with the data set's mean and std: trains. --fp32 trains
without autocast (the float32 control).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--normalize", action="store_true")
    parser.add_argument("--fp32", action="store_true")
    args = parser.parse_args()

    n = 512
    features = torch.stack([
        torch.empty(n).uniform_(20000, 150000),  # annual income
        torch.empty(n).uniform_(1000, 40000),    # loan amount
        torch.empty(n).uniform_(500, 50000),     # credit limit
        torch.empty(n).uniform_(18, 80),         # age
        torch.empty(n).uniform_(0, 480),         # months employed
    ], dim=1)
    target = (features[:, 1] > 0.3 * features[:, 0]).long()  # default
    mean, std = features.mean(0), features.std(0)

    model = nn.Sequential(nn.Linear(5, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=not args.fp32)

    for step in range(args.steps):
        idx = torch.arange(step * 64, (step + 1) * 64) % n
        x = features[idx]
        if args.normalize:
            x = (x - mean) / std
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=not args.fp32):
            pred = model(x)
        loss = F.cross_entropy(pred.float(), target[idx])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
