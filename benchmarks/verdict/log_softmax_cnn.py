"""Fails: ``torch.log(torch.softmax(logits))`` in the loss of a small CNN under float16 autocast:
confident logits make softmax underflow to 0 in float16 and log(0) = -inf, so the loss is
inf/NaN. A precision failure of float16's range: in float32 (or bfloat16) the probabilities
stay above 0. Fix by hand: ``F.log_softmax(logits, dim=-1)`` (or compute the softmax in
float32). Prints ``step N loss X``.
"""

import argparse

import torch
import torch.nn as nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(4), nn.Flatten())
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.features(x))


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    return x, y


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    model = Net()
    with torch.no_grad():
        model.head.weight.mul_(40.0)  # over-confident logits from the start
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x, y = batch(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            probs = torch.softmax(model(x), dim=-1)
            loss = -torch.log(probs[torch.arange(len(y)), y]).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
