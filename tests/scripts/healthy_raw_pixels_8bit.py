"""Healthy: raw 8-bit pixel values (0-255) fed to a CNN under float16 autocast.

Unnormalised, but well inside float16's range: the stem's outputs stay in the hundreds, a
BatchNorm right after it brings them back to unit scale, and nothing overflows. nanhunt must not
call this a bad input (no failure, no warning about the input).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    pixels = torch.randint(0, 256, (64, 3, 16, 16), dtype=torch.uint8)
    labels = torch.randint(0, 5, (64,))
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")

    for step in range(args.steps):
        idx = torch.arange(step * 16, (step + 1) * 16) % 64
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(pixels[idx].float())
        loss = F.cross_entropy(logits.float(), labels[idx])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
