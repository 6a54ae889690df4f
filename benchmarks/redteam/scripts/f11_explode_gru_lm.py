"""Word-level GRU language model (the PyTorch word_language_model recipe: SGD lr=20) with fp16
autocast + GradScaler, after removing the `clip_grad_norm_(..., 0.25)` line.

Reported pattern: the recipe relies on clipping; without it the gradient norm of the recurrent
layer grows by orders of magnitude within a few steps, then overflows; GradScaler starts skipping
steps while the loss printed for the non-skipped ones is still finite.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class GRUCell(nn.Module):
    """Hand-written GRU cell (nn.GRU is not autocast to fp16 on CPU)."""

    def __init__(self, d_in, d_h):
        super().__init__()
        self.ih = nn.Linear(d_in, 3 * d_h)
        self.hh = nn.Linear(d_h, 3 * d_h)

    def forward(self, x, h):
        gi, gh = self.ih(x), self.hh(h)
        i_r, i_z, i_n = gi.chunk(3, -1)
        h_r, h_z, h_n = gh.chunk(3, -1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h


class GRULayer(nn.Module):
    def __init__(self, d_in, d_h):
        super().__init__()
        self.cell = GRUCell(d_in, d_h)
        self.d_h = d_h

    def forward(self, x):
        h = x.new_zeros(x.shape[0], self.d_h)
        out = []
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
            out.append(h)
        return torch.stack(out, 1)


class RNNModel(nn.Module):
    def __init__(self, vocab=1000, d=128):
        super().__init__()
        self.encoder = nn.Embedding(vocab, d)
        self.rnn = GRULayer(d, d)
        self.decoder = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.decoder(self.rnn(self.encoder(ids)))


def corpus(n=20000, vocab=1000):
    # a Zipfian token stream with some local structure
    p = 1.0 / torch.arange(1, vocab + 1)
    toks = torch.multinomial(p / p.sum(), n, replacement=True)
    toks[1::3] = (toks[0::3][: len(toks[1::3])] * 7 + 3) % vocab
    return toks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=20.0)
    ap.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    ap.add_argument("--clip", type=float, default=0.0)
    args = ap.parse_args()
    data = corpus()
    model = RNNModel()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    amp = args.precision == "fp16"
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    bptt, bs = 35, 16
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - bptt - 1, (bs,))
        x = torch.stack([data[s:s + bptt] for s in starts])
        y = torch.stack([data[s + 1:s + bptt + 1] for s in starts])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        scaler.scale(loss).backward()
        if args.clip:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
