"""Fails: a bilinear-pooling CNN applies the signed square root sign(x) * sqrt(|x|) to its pooled
features; many are exactly 0 after the ReLU, the sqrt's derivative there is infinite, and every
backward makes inf/NaN, so GradScaler skips every step and the loss scale collapses.

Autocast fp16 + GradScaler, AdamW.  "pool" (SignedSqrtPool) computes the channel outer product of
the ReLU features, averages it over positions, and applies torch.sign(z) * torch.sqrt(z.abs()).
Channels that are all zero after the ReLU give z == 0 exactly: forward sqrt(0) = 0 (finite),
backward 1 / (2 * sqrt(0)) = inf, times sign(0) = 0 -> NaN.  The forward and the loss stay
finite.
Expected first non-finite value: step 0, phase backward, module "pool", the gradient of its input
(grad_input[0]); GradScaler skips every step and the scale falls from 65536 below 1.
Diagnosis: kind nan_op, module "pool", op aten.sqrt's backward (a division by 2 * sqrt(0)), the
source line with torch.sqrt.  Fix: torch.sqrt(z.abs() + eps) (or clamp_min before the sqrt).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class SignedSqrtPool(nn.Module):
    def forward(self, f):
        f = f.flatten(2)
        z = (f @ f.transpose(1, 2) / f.shape[-1]).flatten(1)
        return torch.sign(z) * torch.sqrt(z.abs())


class BilinearCNN(nn.Module):
    def __init__(self, ch=16, n_classes=5):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, ch, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU())
        with torch.no_grad():
            self.features[2].bias[:4] = -10.0  # four channels the ReLU always zeroes
        self.pool = SignedSqrtPool()
        self.head = nn.Linear(ch * ch, n_classes)

    def forward(self, x):
        return self.head(self.pool(self.features(x)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    model = BilinearCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x = torch.randn(8, 3, 16, 16)
        y = torch.randint(0, 5, (8,))
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
