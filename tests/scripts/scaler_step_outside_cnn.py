"""Fails: the loop steps the optimizer itself while a GradScaler is in use.

A small CNN classifier with autocast (float16) and GradScaler(init_scale=2**32), a large
initial scale copied from a large-model recipe: the scaled gradients overflow float16 on the
first steps and GradScaler would skip them while it calibrates. The loop unscales and then calls
optimizer.step() instead of scaler.step(optimizer), so the inf gradients of step 0 are applied:
SGD's momentum buffer and the conv weights become inf/NaN in that step, although no update was
large before.
--fixed calls scaler.step(optimizer): the calibration steps are skipped and the run trains.
--leftover calls scaler.step(optimizer), scaler.update() and then optimizer.step() (the line
from before the AMP port): step 0's skipped update is applied anyway, after the update.
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
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fixed", action="store_true")
    parser.add_argument("--leftover", action="store_true")
    args = parser.parse_args()

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**32)
    images = torch.randn(256, 3, 16, 16)
    labels = torch.randint(0, 10, (256,))

    for step in range(args.steps):
        idx = torch.arange(step * 32, (step + 1) * 32) % len(images)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(images[idx])
        loss = F.cross_entropy(logits.float(), labels[idx])
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if args.fixed or args.leftover:
            scaler.step(optimizer)
        else:
            optimizer.step()
        scaler.update()
        if args.leftover:
            optimizer.step()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")


if __name__ == "__main__":
    main()
