"""Fails: AdamW (default eps=1e-8) on a float16 CNN: eps is 0 in float16.

A small CNN converted with model.half() and trained with torch.optim.AdamW. Gradients below
~8e-3 make v = 0.001 * grad**2 underflow to 0 in float16, where Adam's eps=1e-8 (below
float16's smallest subnormal 5.96e-8) is 0 too: m / (sqrt(v) + eps) is m / 0 = inf, or 0 / 0 =
NaN where the gradient itself is 0. Some weights are inf/NaN after the first optimizer step.
--optim rmsprop / adagrad use RMSprop / Adagrad (eps=1e-8, the same failure); --fixed eps uses
eps=1e-4;
--fixed master keeps fp32 weights and trains under autocast.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--optim", choices=["adamw", "rmsprop", "adagrad"], default="adamw")
    parser.add_argument("--fixed", choices=["eps", "master"])
    args = parser.parse_args()

    model = Net()
    if args.fixed != "master":
        model = model.half()
    eps = 1e-4 if args.fixed == "eps" else 1e-8
    if args.optim == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)
    elif args.optim == "rmsprop":
        optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, eps=eps)
    else:  # Adagrad's default eps is 1e-10: 0 in float16 too
        optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2, eps=eps)
    images, labels = torch.randn(64, 3, 16, 16), torch.randint(0, 10, (64,))

    for step in range(args.steps):
        idx = torch.arange(step * 16, (step + 1) * 16) % 64
        x = images[idx] if args.fixed == "master" else images[idx].half()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=args.fixed == "master"):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), labels[idx])
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
