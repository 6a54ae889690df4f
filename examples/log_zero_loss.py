"""Fails: a hand-written loss takes torch.log of a probability that underflowed to 0 in fp16.

Expected first non-finite value:
  step 4 (0-based), phase forward, tensor "loss" (+inf), produced by `criterion`
  (NLLFromProbs, not part of the model, so no module name in model.named_modules()).
The model's own outputs stay finite: "softmax" (nn.Softmax) returns fp16 probabilities and, at
step 4 (the first revisit of batch 0), the target-class probabilities of its 8 mislabelled samples,
which the model is now confidently wrong about, round to exactly 0.0 in fp16 (logit gap > ~17.3);
torch.log(0) = -inf, so the (fp32) loss is +inf.  Steps 0-3 are finite everywhere.  The backward
of step 4 is then inf/NaN and GradScaler skips it (again at step 8 with --steps > 8).
Fix: F.cross_entropy on logits (log-softmax in fp32), or clamp probs before torch.log.
"""

import argparse

import torch
import torch.nn as nn

torch.manual_seed(0)


class NLLFromProbs(nn.Module):
    """Cross-entropy written by hand: -log p[target]."""

    def forward(self, probs, target):
        p = probs.gather(1, target[:, None]).float()  # loss in fp32
        return -torch.log(p).mean()


class Classifier(nn.Module):
    def __init__(self, d_in=16, d_hidden=64, n_classes=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(d_hidden, n_classes)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        return self.softmax(self.fc2(self.act(self.fc1(x))))


def make_data(n=256, d_in=16, n_classes=8, n_flipped=8):
    centers = torch.randn(n_classes, d_in) * 3
    y = torch.randint(0, n_classes, (n,))
    x = centers[y] + 0.5 * torch.randn(n, d_in)
    y[:n_flipped] = (y[:n_flipped] + 1) % n_classes  # a few wrong labels
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    x_all, y_all = make_data()
    model = Classifier()
    criterion = NLLFromProbs()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cpu")

    for step in range(args.steps):
        idx = torch.arange(step * args.batch_size, (step + 1) * args.batch_size) % len(x_all)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            probs = model(x_all[idx])
            loss = criterion(probs, y_all[idx])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
