"""Transformer encoder text classifier, fp16 autocast + GradScaler, gradient clipping applied to
the *scaled* gradients (clip_grad_norm_ without scaler.unscale_ first).

clip_grad_norm_(max_norm=1.0) sees gradients multiplied by the loss scale (2^16), clips them to
norm 1, and scaler.step() then divides by 2^16 again: every update is ~1/65536 of what was
intended and the classifier barely moves (the loss stays at chance while --fixed, with
scaler.unscale_(opt) before clipping, learns).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
V, T = 1000, 32


class Classifier(nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.embed = nn.Embedding(V, d)
        layer = nn.TransformerEncoderLayer(d, 4, 256, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 4)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fixed", action="store_true")
    a = p.parse_args()
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    ids_all = torch.randint(0, V, (1024, T))
    y_all = (ids_all < 250).sum(1).sub(8).clamp(0, 3)        # label from token counts
    for step in range(a.steps):
        idx = torch.randint(0, 1024, (64,))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(ids_all[idx]).float(), y_all[idx])
        scaler.scale(loss).backward()
        if a.fixed:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
