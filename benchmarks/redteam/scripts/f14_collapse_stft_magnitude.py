"""Speech enhancement (Conv-TasNet-like waveform model) with a spectral-magnitude loss,
fp16 autocast + GradScaler: the scale halves every step and the model never updates.

Reported pattern: the loss compares STFT magnitudes computed by hand as
sqrt(re^2 + im^2). Utterances are zero-padded to the batch length and the model's output is
multiplied by the length mask, so padded frames are exactly 0: sqrt(0) is fine in the forward,
but its derivative 1 / (2 sqrt(0)) gives NaN in every backward. GradScaler treats it as an
overflow forever. (sqrt(re^2 + im^2 + 1e-8), or torch.stft(...).abs(), fixes it.)
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class STFTMagnitude(nn.Module):
    """STFT as a fixed Conv1d with cos/sin kernels (as in asteroid's free/analytic filterbanks)."""

    def __init__(self, n_fft=128, hop=32):
        super().__init__()
        n = torch.arange(n_fft)
        k = torch.arange(n_fft // 2 + 1)[:, None]
        win = torch.hann_window(n_fft)
        self.register_buffer("cos", (torch.cos(2 * math.pi * k * n / n_fft) * win)[:, None])
        self.register_buffer("sin", (-torch.sin(2 * math.pi * k * n / n_fft) * win)[:, None])
        self.hop = hop

    def forward(self, wav):
        re = F.conv1d(wav[:, None], self.cos, stride=self.hop)
        im = F.conv1d(wav[:, None], self.sin, stride=self.hop)
        return torch.sqrt(re ** 2 + im ** 2)


class Enhancer(nn.Module):
    def __init__(self, ch=64):
        super().__init__()
        self.encoder = nn.Conv1d(1, ch, 16, stride=8, padding=4)
        self.separator = nn.Sequential(
            nn.Conv1d(ch, ch, 3, padding=1), nn.PReLU(), nn.Conv1d(ch, ch, 3, padding=1), nn.Sigmoid())
        self.decoder = nn.ConvTranspose1d(ch, 1, 16, stride=8, padding=4)

    def forward(self, noisy):
        w = F.relu(self.encoder(noisy[:, None]))
        return self.decoder(w * self.separator(w))[:, 0]


def batch(bs=8, max_len=2400):
    lens = torch.randint(1200, max_len, (bs,))
    t = torch.arange(max_len) / 8000
    clean = torch.sin(2 * math.pi * (200 + 300 * torch.rand(bs, 1)) * t) * 0.5
    mask = (torch.arange(max_len)[None] < lens[:, None]).float()
    clean = clean * mask
    noisy = (clean + 0.1 * torch.randn_like(clean)) * mask
    return noisy, clean, mask


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    model = Enhancer()
    spec = STFTMagnitude()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        noisy, clean, mask = batch()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            est = model(noisy) * mask
            loss = F.l1_loss(spec(est), spec(clean))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
