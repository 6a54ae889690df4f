"""Small U-Net for binary segmentation with a hand-written BCE, fp16 autocast + GradScaler.

Reported pattern: "loss becomes nan after a few hundred iterations with AMP" (here: a few
steps). As the net gets confident, foreground logits pass ~8.3 and torch.sigmoid in float16
rounds them to exactly 1.0; log(1 - p) = log(0) = -inf, and (1 - y) = 0 on those pixels turns
it into 0 * -inf = nan. (BCEWithLogitsLoss fixes it.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def conv_block(c_in, c_out):
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
                         nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())


class UNet(nn.Module):
    def __init__(self, ch=16):
        super().__init__()
        self.enc1 = conv_block(1, ch)
        self.enc2 = conv_block(ch, 2 * ch)
        self.up = nn.ConvTranspose2d(2 * ch, ch, 2, stride=2)
        self.dec1 = conv_block(2 * ch, ch)
        self.out = nn.Conv2d(ch, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        return self.out(self.dec1(torch.cat([self.up(e2), e1], 1)))


def bce_loss(logits, target):
    p = torch.sigmoid(logits)
    return -(target * torch.log(p) + (1 - target) * torch.log(1 - p)).mean()


def make_batch(n=8, size=32):
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    c = torch.randint(8, 24, (n, 2, 1, 1))
    r = torch.randint(4, 9, (n, 1, 1))
    mask = (((yy - c[:, 0]) ** 2 + (xx - c[:, 1]) ** 2) < r ** 2).float()[:, None]
    img = mask * 0.8 + 0.1 * torch.randn(n, 1, size, size)
    return img, mask


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    model = UNet()
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        img, mask = make_batch()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = bce_loss(model(img), mask)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
