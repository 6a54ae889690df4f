"""Keyword spotting on raw waveforms (wav2vec-style conv front-end) with fp16 autocast.

Reported pattern: the corpus mixes 16-bit and 24-bit wav files. The loader divides by 32768,
assuming int16, but scipy.io.wavfile returns 24-bit files as left-justified int32 (full scale
2^31), so those clips reach +-65536 after the division. The first 24-bit clip (batch 2,
sample 5) is a loud one: under autocast its samples exceed float16's max (65504) when cast for
the first Conv1d, and the loss is nan at that step.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
SR = 16000


def read_wavs(step, n, labels):
    t = torch.arange(SR // 2) / SR
    out = []
    for i in range(n):
        f0 = 80.0 + 40.0 * labels[i]
        gain = 8000 + 22000 * torch.rand(())
        if step == 2 and i == 5:
            gain = torch.tensor(33000.0)  # a loud clip, clipped at full scale
        sig = torch.sin(2 * torch.pi * f0 * t) + 0.5 * torch.sin(2 * torch.pi * 2.1 * f0 * t)
        sig = (gain * sig / 1.5 + 300 * torch.randn_like(t)).clamp(-32768, 32767).round()
        if step == 2 and i == 5:  # a 24-bit recording: scipy gives int32, left-justified
            sig = sig * 65536
        out.append(sig.to(torch.int32))
    return torch.stack(out)


class FeatureEncoder(nn.Module):
    def __init__(self, ch=64):
        super().__init__()
        self.conv0 = nn.Conv1d(1, ch, kernel_size=64, stride=16)
        self.conv1 = nn.Conv1d(ch, ch, kernel_size=5, stride=4)
        self.conv2 = nn.Conv1d(ch, ch, kernel_size=3, stride=2)

    def forward(self, wav):
        x = F.gelu(self.conv0(wav[:, None]))
        x = F.gelu(self.conv1(x))
        return F.gelu(self.conv2(x))


class KWS(nn.Module):
    def __init__(self, n_cls=4):
        super().__init__()
        self.encoder = FeatureEncoder()
        self.classifier = nn.Linear(64, n_cls)

    def forward(self, wav):
        return self.classifier(self.encoder(wav).mean(-1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    model = KWS()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        y = torch.randint(0, 4, (16,))
        wav = read_wavs(step, 16, y).float() / 32768.0
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(wav), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
