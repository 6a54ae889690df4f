"""Word-level Elman RNN LM (nn.RNN, tanh) trained with SGD lr=5, fp16 autocast + GradScaler,
no gradient clipping.

Reported pattern: RNN LM recipes clip gradients (clip_grad_norm_ 0.25 in the PyTorch example);
this script left that out. The recurrent layer's gradient norm grows by orders of magnitude
within a few steps (backprop through 35 time steps), the loss climbs, and the gradients end up
non-finite so GradScaler starts skipping steps. Re-running with --clip 0.25 trains.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

def corpus(n=20000, vocab=1000):
    # a Zipfian word-id stream with some local structure (stands in for a tokenised corpus)
    p = 1.0 / torch.arange(1, vocab + 1)
    toks = torch.multinomial(p / p.sum(), n, replacement=True)
    toks[1::3] = (toks[0::3][: len(toks[1::3])] * 7 + 3) % vocab
    return toks


class WordRNN(nn.Module):
    def __init__(self, vocab, d=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rnn = nn.RNN(d, d, nonlinearity="tanh", batch_first=True)
        self.proj = nn.Linear(d, vocab)

    def forward(self, ids):
        h, _ = self.rnn(self.embed(ids))
        return self.proj(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=5.0)
    ap.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    ap.add_argument("--clip", type=float, default=0.0)
    args = ap.parse_args()
    data = corpus()
    model = WordRNN(1000)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    amp = args.precision == "fp16"
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    seq, bs = 35, 16
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - seq - 1, (bs,))
        x = torch.stack([data[s:s + seq] for s in starts])
        y = torch.stack([data[s + 1:s + seq + 1] for s in starts])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, 1000), y.reshape(-1))
        scaler.scale(loss).backward()
        if args.clip:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
