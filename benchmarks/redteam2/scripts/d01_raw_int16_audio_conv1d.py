"""Raw-waveform keyword spotter (SincNet-like wide first conv, 1D-conv stack), fp16 autocast +
GradScaler, fed int16 PCM samples converted with .float() but never divided by 32768.

The recordings are loud and noisy (near full scale, heavy clipping: |x| up to 32767). The samples
themselves fit fp16, but the first conv sums 251 taps of them: its output reaches ~1e5 and
overflows fp16 in the very first forward, at every step (GradScaler lowers the scale forever,
the loss is inf/NaN). Dividing by 32768 (--normalize) trains.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class WaveKWS(nn.Module):
    def __init__(self, n_cls=10):
        super().__init__()
        self.front = nn.Conv1d(1, 32, 251, stride=10)
        self.body = nn.Sequential(nn.ReLU(), nn.MaxPool1d(3),
                                  nn.Conv1d(32, 64, 5, stride=2), nn.ReLU(),
                                  nn.Conv1d(64, 64, 5, stride=2), nn.ReLU())
        self.fc = nn.Linear(64, n_cls)

    def forward(self, wav):
        return self.fc(self.body(self.front(wav[:, None])).mean(-1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--normalize", action="store_true")
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    model = WaveKWS()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    t = torch.arange(8000) / 8000.0
    for step in range(a.steps):
        y = torch.randint(0, 10, (16,))
        f0 = 150.0 + 40.0 * y[:, None]
        wave = 2.0 * torch.sin(2 * torch.pi * f0 * t) + 2.0 * torch.randn(16, 8000)  # loud, noisy
        pcm = (wave.clamp(-1, 1) * 32767).to(torch.int16)          # clipped, as read from disk
        x = pcm.float() / 32768 if a.normalize else pcm.float()
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
