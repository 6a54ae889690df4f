"""Fails quietly: a segmentation CNN sums its loss over every pixel (reduction="sum"), so the loss
and its gradients are ~2e3 times what a mean gives, and GradScaler keeps skipping steps.

Autocast fp16 + GradScaler (default init_scale 2**16), SGD.  F.cross_entropy(..., reduction="sum")
over 8 x 16 x 16 = 2048 pixels gives a loss of ~3e3; scaled by 2**16 the gradients overflow fp16,
GradScaler skips and halves the scale, and it needs ~8 skips to come down to a scale where the
summed gradients fit; with growth_interval=4 (as some recipes set) it grows back and skips again,
so a large share of the run's steps are skipped.  ``--mean`` uses reduction="mean" (the healthy
control).
Expected: phase loss_scaling, kind loss_scale: a large share of steps skipped; the loss is large
because it is summed over many elements; an init_scale computed from the scaled gradients'
exponents.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class SegNet(nn.Module):
    def __init__(self, ch=8, n_classes=4):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, ch, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU())
        self.classifier = nn.Conv2d(ch, n_classes, 1)

    def forward(self, x):
        return self.classifier(self.features(x))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--mean", action="store_true")
    args = parser.parse_args()

    model = SegNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6 if not args.mean else 1e-2,
                                momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", growth_interval=4)
    for step in range(args.steps):
        x = torch.randn(8, 3, 16, 16)  # small: float16 convolutions are slow on CPU
        y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y, reduction="mean" if args.mean else "sum")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
