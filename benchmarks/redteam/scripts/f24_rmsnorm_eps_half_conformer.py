"""Conv speech encoder (Conformer-ish conv front-end + RMSNorm) in pure fp16 with a
hand-written RMSNorm whose eps is 1e-12.

Reported pattern: "nan from the first batch in half precision". Utterances are zero-padded;
the bias-free subsampling convolution maps padded regions to exactly-zero frames, so their
mean square is 0 and `rsqrt(0 + 1e-12)` in float16 is rsqrt(0) = inf (1e-12 rounds to 0 in
float16); 0 * inf = nan. In float32 the eps keeps it finite. (eps=1e-5/1e-6, or computing the
norm in float32 as LLaMA's RMSNorm does, fixes it.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-12):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):  # x: (B, T, C)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class ConvBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = RMSNorm(d)
        self.dw = nn.Conv1d(d, d, 5, padding=2, groups=d)
        self.pw = nn.Conv1d(d, d, 1)

    def forward(self, x):
        h = self.norm(x).transpose(1, 2)
        return x + self.pw(F.silu(self.dw(h))).transpose(1, 2)


class SpeechEncoder(nn.Module):
    def __init__(self, n_mels=40, d=96, n_cls=10):
        super().__init__()
        self.subsample = nn.Conv1d(n_mels, d, 3, stride=2, padding=1, bias=False)
        self.blocks = nn.ModuleList([ConvBlock(d) for _ in range(2)])
        self.out_norm = RMSNorm(d)
        self.head = nn.Linear(d, n_cls)

    def forward(self, feats):  # feats: (B, n_mels, T), zero-padded
        x = self.subsample(feats).transpose(1, 2)
        for b in self.blocks:
            x = b(x)
        return self.head(self.out_norm(x).mean(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    args = p.parse_args()
    model = SpeechEncoder()
    dtype = torch.float16 if args.precision == "fp16" else torch.float32
    model = model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(args.steps):
        lens = torch.randint(60, 121, (8,))
        feats = torch.randn(8, 40, 120) * (torch.arange(120)[None] < lens[:, None])[:, None]
        y = torch.randint(0, 10, (8,))
        opt.zero_grad()
        loss = F.cross_entropy(model(feats.to(dtype)).float(), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
