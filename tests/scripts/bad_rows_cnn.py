"""Fails: two corrupt images in one batch of a small CNN trained in bfloat16 autocast, no
GradScaler: rows 2 and 6 of step 3's batch hold NaN pixels, the loss and every gradient are NaN,
SGD writes NaN into every weight and every later loss is nan.

``--replace-rows`` replaces those rows of step 3's images and labels by the batch's row 0 by
hand, which is what ``--fix skip-samples=3:2,6`` does from outside (the images at the model's
call, the labels at the functional loss's).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def batches(steps: int):
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 1, 16, 16, generator=g)
        y = (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0, :8].mean(dim=(1, 2)) > 0).long()
        if step == 3:
            x[2, 0, 5, 5] = float("nan")  # two corrupt images
            x[6, 0, 9:, 3] = float("nan")
        yield x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--replace-rows", action="store_true")
    args = parser.parse_args()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, (inputs, targets) in enumerate(batches(args.steps)):
        if args.replace_rows and step == 3:
            inputs, targets = inputs.clone(), targets.clone()
            inputs[[2, 6]], targets[[2, 6]] = inputs[0].clone(), targets[0].clone()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
