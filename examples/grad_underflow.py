"""Underflow, no NaN: in pure fp16 most gradients flush to 0 and the weights never move.

model.half(), no autocast, no GradScaler.  The reconstruction loss is a mean over a large output
(64 x 512 values) and is then weighted by 2e-4, so d(loss)/d(output) = ~1.2e-8 * error, which
rounds to 0 in fp16 (smallest subnormal 5.96e-8) unless |error| > ~2.4.
Expected: no non-finite value at any step, phase or module.  The problem is underflow at every
step (0-based, all of them) in phase backward, starting at the model output: module "decoder",
tensor grad_output[0] is ~97% exact zeros and ~3% subnormals (amax 6e-8); the parameter
gradients ("encoder.weight.grad", "encoder.bias.grad", "decoder.weight.grad",
"decoder.bias.grad") are together ~50-60% zeros, the rest subnormal (max |grad| ~1e-6).
After the default 10 SGD steps < 0.3% of the weights have changed at all (the same run in fp32
updates every weight); the loss only varies with the batch.
Fix: fp32 weights + autocast + torch.amp.GradScaler (GradScaler refuses to unscale fp16 grads),
or at least multiply the loss by a constant scale and divide the gradients by it in fp32.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class AutoEncoder(nn.Module):
    def __init__(self, d=512, d_code=64):
        super().__init__()
        self.encoder = nn.Linear(d, d_code)
        self.act = nn.GELU()
        self.decoder = nn.Linear(d_code, d)

    def forward(self, x):
        return self.decoder(self.act(self.encoder(x)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--recon-weight", type=float, default=2e-4)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    data = torch.randn(256, 16) @ torch.randn(16, 512) / 4  # low-rank: learnable
    model = AutoEncoder().half()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for step in range(args.steps):
        idx = torch.arange(step * 64, (step + 1) * 64) % len(data)
        x = data[idx].half()
        noisy = x + 0.1 * torch.randn_like(x)
        optimizer.zero_grad()
        recon = model(noisy)
        loss = args.recon_weight * F.mse_loss(recon, x)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4e}")


if __name__ == "__main__":
    main()
