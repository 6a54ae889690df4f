"""Vision-transformer classifier on 16-bit microscopy images (uint16 TIFF counts 0..65535),
fp16 autocast + GradScaler, images converted with .float() and never rescaled.

Bright cells saturate the 16-bit detector at 65535, which is above fp16's largest finite value
(65504): autocast's cast of the patches for the patch-embedding Linear turns them into +inf at
every step (loss NaN, GradScaler halves the scale every step). The input itself cannot be
represented in fp16. Dividing by 65535 (--normalize) trains.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
P = 8


class ViT(nn.Module):
    def __init__(self, d=64, n_cls=4, n_patch=16):
        super().__init__()
        self.patch = nn.Linear(P * P, d)
        self.pos = nn.Parameter(torch.randn(n_patch, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, n_cls)

    def forward(self, img):                       # img: (B, 32, 32)
        b = img.shape[0]
        patches = img.unfold(1, P, P).unfold(2, P, P).reshape(b, -1, P * P)
        return self.head(self.encoder(self.patch(patches) + self.pos).mean(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--normalize", action="store_true")
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    model = ViT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    for step in range(a.steps):
        y = torch.randint(0, 4, (32,))
        r = 3.0 + 2.0 * y[:, None, None]                       # cell size = class
        cell = torch.exp(-((yy - 16) ** 2 + (xx - 16) ** 2) / (2 * r ** 2))
        counts = (800 + 90000 * cell + 200 * torch.randn(32, 32, 32)).clamp(0, 65535)
        img16 = counts.to(torch.int32)                         # as read from a uint16 TIFF
        x = img16.float() / 65535 if a.normalize else img16.float()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
