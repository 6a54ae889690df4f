"""A tiny ViT classifier (4x4 patches of 8x8 images, a class token, pre-LN blocks, a head) on
synthetic images; see curves_common.py for the flags that make it fail without NaN."""

import torch
from curves_common import Trunk, parse, train
from torch import nn

D, CLASSES = 32, 4


class ViT(nn.Module):
    def __init__(self, args) -> None:
        super().__init__()
        self.patch = nn.Linear(16, D)
        self.cls = nn.Parameter(torch.zeros(1, 1, D))
        self.pos = nn.Parameter(torch.randn(1, 5, D) * 0.02)
        self.trunk = Trunk(D, 2, args.depth, False, args.post_ln, args.qk_norm)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, img):
        b = img.shape[0]
        p = img.reshape(b, 2, 4, 2, 4).permute(0, 1, 3, 2, 4).reshape(b, 4, 16)
        x = torch.cat([self.cls.expand(b, 1, D), self.patch(p)], dim=1) + self.pos
        return self.head(self.trunk(x)[:, 0])


def batch(step, g):
    # the class is how many of the four quadrants are bright (0-3)
    y = torch.randint(0, CLASSES, (32,), generator=g)
    img = torch.randn(32, 8, 8, generator=g) * 0.3
    for i, c in enumerate(y.tolist()):
        for quad in torch.randperm(4, generator=g)[:c].tolist():
            r, q = divmod(quad, 2)
            img[i, 4 * r:4 * r + 4, 4 * q:4 * q + 4] += 1.0
    return img, y


if __name__ == "__main__":
    args = parse()
    torch.manual_seed(args.seed)
    model = ViT(args)
    dtype = torch.bfloat16 if args.weights == "bf16" else torch.float32
    train(args, model, lambda s, g: (lambda x, y: (x.to(dtype), y))(*batch(s, g)))
