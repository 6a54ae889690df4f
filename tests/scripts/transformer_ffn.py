"""Fails: the FFN output of every post-norm transformer layer overflows fp16, and exceeds 65504
in float32 too, so the float32 region must run on through each layer's norm2.

nn.TransformerEncoder of two post-norm nn.TransformerEncoderLayer (x = norm2(x + ffn(x))),
autocast fp16 + GradScaler. The FFN weights come from a checkpoint converted with the wrong
units (x300): "encoder.layers.0.linear2" outputs values above 65504 (+/-inf) at step 0,
forward, and so does "encoder.layers.1.linear2" once layer 0 is fixed. Both float32 outputs
exceed 65504; "encoder.layers.N.norm2" (LayerNorm) brings the values back in range. An fp32
region for layer 0 alone is not enough; the region for every layer's linear2 through its norm2
trains.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Classifier(nn.Module):
    def __init__(self, d=32, n_layers=2, n_classes=4):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=64, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, n_classes)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    model = Classifier()
    with torch.no_grad():
        for layer in model.encoder.layers:  # a checkpoint in other units
            layer.linear1.weight.mul_(FFN_GAIN)
            layer.linear2.weight.mul_(FFN_GAIN)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        x = torch.randn(8, 16, 32)
        y = (x[:, 0, 0] > 0).long() + 2 * (x[:, 0, 1] > 0).long()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


FFN_GAIN = 300.0

if __name__ == "__main__":
    main()
