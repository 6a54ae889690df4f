"""Speaker-embedding 1D-conv network (x-vector style) trained with an angular prototypical
loss on the pairwise angle matrix, fp16 autocast + GradScaler, 10 steps.

The model's PairwiseAngles module computes theta = acos(clamp(e @ e.T, -1 + 1e-7, 1 - 1e-7)) for
all pairs, the diagonal (self-pairs) included and masked out afterwards. The clamp was meant to
keep acos away from +-1, but 1 - 1e-7 rounds to exactly 1.0 in fp16, so every self-similarity
that rounds to 1.0 reaches acos at the boundary: forward acos(1) = 0 is finite, backward
-1/sqrt(1 - 1) = -inf, times the masked (zero) gradient = NaN. Every step skips and the scale
halves each time. In float32 the clamp works (--precision fp32 trains).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class PairwiseAngles(nn.Module):
    def forward(self, e):
        cos = e @ e.transpose(0, 1)
        return torch.acos(cos.clamp(-1 + 1e-7, 1 - 1e-7))


class XVector(nn.Module):
    def __init__(self, n_mels=40, c=64, dim=64):
        super().__init__()
        self.tdnn = nn.Sequential(
            nn.Conv1d(n_mels, c, 5, padding=2), nn.ReLU(), nn.BatchNorm1d(c),
            nn.Conv1d(c, c, 3, dilation=2, padding=2), nn.ReLU(), nn.BatchNorm1d(c),
            nn.Conv1d(c, c, 3, dilation=3, padding=3), nn.ReLU(), nn.BatchNorm1d(c))
        self.embed = nn.Linear(2 * c, dim)
        self.angles = PairwiseAngles()

    def forward(self, feats):
        h = self.tdnn(feats)
        stats = torch.cat([h.mean(-1), h.std(-1)], -1)       # statistics pooling
        e = F.normalize(self.embed(stats), dim=-1)
        return self.angles(e)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    model = XVector()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    voices = torch.randn(200, 40, 1)                          # per-speaker spectral envelope
    n_spk = 16
    for step in range(a.steps):
        spk = torch.randperm(200)[:n_spk].repeat_interleave(2)   # 2 utterances per speaker
        feats = voices[spk] + 0.8 * torch.randn(2 * n_spk, 40, 40)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            theta = model(feats)
        eye = torch.eye(2 * n_spk, dtype=torch.bool)
        logits = (-10.0 * theta.float()).masked_fill(eye, -1e4)   # exclude self-pairs
        target = torch.arange(2 * n_spk) ^ 1                    # the other utterance
        loss = F.cross_entropy(logits, target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
