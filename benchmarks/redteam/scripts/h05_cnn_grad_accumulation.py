"""HEALTHY: CNN classifier with gradient accumulation over 4 micro-batches, fp16 autocast +
GradScaler (scale(loss / accum).backward() each micro-batch; unscale_/clip/step/update once per
4).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def make_model():
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    args = p.parse_args()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    protos = torch.randn(10, 3, 16, 16)
    for step in range(args.steps):
        optimizer.zero_grad()
        total = 0.0
        for _ in range(args.accum):
            y = torch.randint(0, 10, (16,))
            x = protos[y] + 0.5 * torch.randn(16, 3, 16, 16)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y) / args.accum
            scaler.scale(loss).backward()
            total += loss.item()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {total:.4f}")


if __name__ == "__main__":
    main()
