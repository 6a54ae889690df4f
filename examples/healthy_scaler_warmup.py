"""Healthy: GradScaler(init_scale=2**24) skips the first steps, then recovers and trains.

Autocast fp16.  Alarming but harmless: with the loss scaled by 2**24 the fp16 backward overflows,
so steps 0-4 and 7 (0-based) have inf/NaN gradients (phase backward, starting with the gradient
of the model's fp16 output: module "", grad_output[0], then "head" grad_output[0], ...).
GradScaler skips those six steps and halves the scale each time: 2**24 -> 2**18 = 262144, where
it stays.  From step 8 on every value is finite, no step is skipped and the loss goes down
(~1.6 -> ~0.15).  Each line also prints the scale after that step's update.
--plant STEP (use STEP >= 8): from that step on the learning rate is inf (an LR schedule that
divides by zero).  First non-finite value then: step STEP, phase optimizer, the parameters right
after optimizer.step(), first "body.0.weight" (every parameter becomes inf/NaN); the forward,
loss and gradients of that step are finite (the warmup overflows of steps 0-4 and 7 still come
earlier in the run; they are not failures).  From the next step on everything is NaN and
GradScaler skips every step.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self, d_in=20, d_hidden=64, n_classes=5):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_hidden), nn.ReLU()
        )
        self.head = nn.Linear(d_hidden, n_classes)

    def forward(self, x):
        return self.head(self.body(x))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--plant", type=int, default=None, metavar="STEP")
    args = parser.parse_args()

    centers = torch.randn(5, 20)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)

    for step in range(args.steps):
        if args.plant is not None and step >= args.plant:
            for group in optimizer.param_groups:
                group["lr"] = float("inf")
        y = torch.randint(0, 5, (64,))
        x = centers[y] + torch.randn(64, 20)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
