"""Character-level LM with a tanh nn.RNN whose recurrent weights were initialised too large
(normal std 2/sqrt(H), spectral radius ~2), fp16 autocast + GradScaler, SGD, no clipping.

Pascanu et al. (2013): with a recurrent spectral radius > 1 the hidden dynamics are chaotic and
back-propagation through time multiplies the gradient at every step, so the rnn's gradient
(not the decoder's) is orders of magnitude larger than it should be and keeps overflowing
fp16 however far GradScaler lowers the scale; the few updates that do get through make it
worse. --clip 1 trains (the explosion is in the gradient, not in fp16: --precision fp32 without
clipping also fails to learn).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
V, T = 64, 80


class CharRNN(nn.Module):
    def __init__(self, hidden=256):
        super().__init__()
        self.embed = nn.Embedding(V, 32)
        self.rnn = nn.RNN(32, hidden, batch_first=True)
        nn.init.normal_(self.rnn.weight_hh_l0, std=2.0 / hidden ** 0.5)
        self.decoder = nn.Linear(hidden, V)

    def forward(self, ids):
        h, _ = self.rnn(self.embed(ids))
        return self.decoder(h)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    text = torch.randint(0, V, (40000,))
    text = torch.where(torch.rand(40000) < 0.6, (torch.roll(text, 1) * 3 + 1) % V, text)
    model = CharRNN()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    for step in range(a.steps):
        starts = torch.randint(0, 40000 - T - 1, (32,))
        chunk = torch.stack([text[s:s + T + 1] for s in starts])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, V), chunk[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        if a.clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
