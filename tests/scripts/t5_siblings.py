"""Fails: the FFN output (DenseReluDense.wo) of both T5-style blocks overflows fp16, one after
the other.

T5-style encoder: each block is pre-norm, x = x + DenseReluDense(layer_norm(x)), with a
hand-written T5LayerNorm (RMS, no mean, `variance_epsilon`), and a final_layer_norm. Autocast
fp16 + GradScaler. From step 2 the data carry an outlier feature that grows each step (a sensor
spike); the FFN weights are initialised too large (std 1), so the FFN outputs grow with it:
encoder.block.1.layer.0.DenseReluDense.wo overflows first (its float32 output exceeds 65504 too),
encoder.block.0.layer.0.DenseReluDense.wo a few steps later. An fp32 region for block 1's wo
alone only moves the failure later; the region for every block's wo, through the next norm
(where values are back in range), trains.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class T5LayerNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x


class DenseReluDense(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.wi = nn.Linear(d, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d, bias=False)

    def forward(self, x):
        return self.wo(F.relu(self.wi(x)))


class LayerFF(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.DenseReluDense = DenseReluDense(d, d_ff)

    def forward(self, x):
        return x + self.DenseReluDense(x)


class Block(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.layer = nn.ModuleList([LayerFF(d, d_ff)])

    def forward(self, x):
        for layer in self.layer:
            x = layer(x)
        return x


class Encoder(nn.Module):
    def __init__(self, d=32, d_ff=128, n_blocks=2):
        super().__init__()
        self.block = nn.ModuleList([Block(d, d_ff) for _ in range(n_blocks)])
        self.final_layer_norm = T5LayerNorm(d)

    def forward(self, x):
        for block in self.block:
            x = block(x)
        return self.final_layer_norm(x)


class Model(nn.Module):
    def __init__(self, n_classes=4):
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(32, n_classes)

    def forward(self, x):
        return self.head(self.encoder(x))


def make_batch(step, batch_size=32, d_in=32):
    x = torch.randn(batch_size, d_in)
    y = (x[:, 1] > 0).long() + 2 * (x[:, 2] > 0).long()
    return 290.0 * x * UNITS**step, y  # raw sensor units, drifting up each step


UNITS = 1.3
WI_STD = 0.35


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()

    model = Model()
    for name, p in model.named_parameters():
        if "DenseReluDense" in name:
            nn.init.normal_(p, std=WI_STD)  # too large for raw-unit inputs
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x, y = make_batch(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
