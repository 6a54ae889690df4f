"""Healthy: a small CNN with BatchNorm2d trains on random images under autocast fp16 + GradScaler.

Alarming but harmless: under CPU autocast the convolutions and BatchNorm2d run in fp16, the
BatchNorm running statistics and all parameters stay fp32, and ReLU + max-pooling make many
activations exact zeros.  All module outputs, losses, gradients and parameters are finite,
GradScaler skips no step and the loss goes down.
--plant STEP: at that step one pixel of the image batch is NaN (sample 5, channel 0, row 3,
column 7).  First non-finite value then: step STEP, phase data, the input batch (the model's
input[0], shape [32, 3, 16, 16]), exactly one NaN.  Next, in the same step's forward, "features.0"
(Conv2d) output is NaN only around that pixel of sample 5, and "features.1" (BatchNorm2d) output
is NaN for the whole batch (batch statistics); the step's loss and backward are NaN and GradScaler
skips it.  The NaN also lands in the running_mean / running_var buffers of "features.1" and
"features.5": later training steps are finite again (they use batch statistics), but
model.eval() gives NaN from then on.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class SmallCNN(nn.Module):
    def __init__(self, n_classes=4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(16, n_classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--plant", type=int, default=None, metavar="STEP")
    args = parser.parse_args()

    colors = torch.randn(4, 3, 1, 1)  # each class has its own tint
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")

    for step in range(args.steps):
        labels = torch.randint(0, 4, (32,))
        images = colors[labels] + torch.randn(32, 3, 16, 16)
        if step == args.plant:
            images[5, 0, 3, 7] = float("nan")
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
