"""Crashes: scaler.unscale_(optimizer) is called twice in one step.

A CNN with autocast (float16) and GradScaler. A helper that logs the gradient norm unscales, and
the loop unscales again before clipping: the second call raises "RuntimeError: unscale_() has
already been called on this optimizer since the last update()." at step 0.
--fixed unscales once, then logs and clips.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def grad_norm(model, optimizer, scaler):
    scaler.unscale_(optimizer)  # the gradients must be unscaled to be meaningful
    return torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fixed", action="store_true")
    args = parser.parse_args()

    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * 10 * 10, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    images, labels = torch.randn(64, 1, 12, 12), torch.randint(0, 10, (64,))

    for step in range(args.steps):
        idx = torch.arange(step * 16, (step + 1) * 16) % 64
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(images[idx])
        loss = F.cross_entropy(logits.float(), labels[idx])
        scaler.scale(loss).backward()
        norm = grad_norm(model, optimizer, scaler) if not args.fixed else None
        if args.fixed:
            scaler.unscale_(optimizer)
            norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        else:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} grad norm {norm.item():.3f}")


if __name__ == "__main__":
    main()
