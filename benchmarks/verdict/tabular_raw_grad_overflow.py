"""Fails: unnormalised tabular features (in the thousands) into an MLP under float16 autocast
with GradScaler: the first layer's weight gradient (features x the scaled output gradient)
overflows float16 at every scale GradScaler tries, so it skips step after step and the model
never trains. Fix by hand: standardise the features (or a lower init_scale). Prints
``step N loss X skipped`` per step.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.rand(64, 12, generator=g) * 3000.0  # raw counts, never standardised
    y = (x[:, :3].sum(dim=1, keepdim=True) / 4500.0 - 1.0)
    return x, y


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 1))
    with torch.no_grad():
        model[0].weight.mul_(1e-3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    for step in range(args.steps):
        x, y = batch(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}"
              + ("  skipped" if scaler.get_scale() < before else ""), flush=True)


if __name__ == "__main__":
    main()
