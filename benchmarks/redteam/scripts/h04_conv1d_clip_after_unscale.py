"""HEALTHY: 1D-conv + GRU speech command classifier, fp16 autocast + GradScaler, gradients
clipped the documented way: scaler.unscale_(optimizer), clip_grad_norm_, scaler.step, update.
The norm returned by clip_grad_norm_ may be inf on a step GradScaler then skips; that is fine.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Hand_GRU(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.x2h = nn.Linear(d, 3 * d)
        self.h2h = nn.Linear(d, 3 * d)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], x.shape[2])
        for t in range(x.shape[1]):
            xr, xz, xn = self.x2h(x[:, t]).chunk(3, -1)
            hr, hz, hn = self.h2h(h).chunk(3, -1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            h = (1 - z) * torch.tanh(xn + r * hn) + z * h
        return h


class KWS(nn.Module):
    def __init__(self, n_mels=40, d=64, n_cls=12):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(n_mels, d, 5, stride=2, padding=2), nn.BatchNorm1d(d),
                                  nn.ReLU(), nn.Conv1d(d, d, 3, padding=1), nn.ReLU())
        self.rnn = Hand_GRU(d)
        self.fc = nn.Linear(d, n_cls)

    def forward(self, mel):
        return self.fc(self.rnn(self.conv(mel).transpose(1, 2)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    model = KWS()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    protos = torch.randn(12, 40, 1)
    for step in range(args.steps):
        y = torch.randint(0, 12, (16,))
        mel = protos[y] + 0.5 * torch.randn(16, 40, 40)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(mel), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        gnorm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} grad_norm {gnorm.item():.3f}")


if __name__ == "__main__":
    main()
