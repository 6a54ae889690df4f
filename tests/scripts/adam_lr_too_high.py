"""Fails: Adam's learning rate is far too high, and the weights grow by about lr every step.

Adam moves each weight by up to lr a step whatever the gradient's size (m / sqrt(v) is about
1), so with lr=1.0 every weight grows by about 1 a step: linear growth, not geometric, until an
activation exceeds float16's max under autocast. Clipping the gradient norm changes nothing:
Adam's step does not scale with the gradient. A lower lr trains.
--arch transformer: a small pre-norm transformer LM; --arch gru: a GRU LM.
--lr sets the learning rate (the failure is the default 1.0); --clip N clips the gradient norm
after unscale_ (the wrong fix: the run still fails).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        a = self.ln1(x)
        x = x + self.attn(a, a, a, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


class GRULM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, 64, batch_first=True)
        self.head = nn.Linear(64, vocab)

    def forward(self, tokens):
        return self.head(self.rnn(self.embed(tokens))[0])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", choices=("transformer", "gru"), default="transformer")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--clip", type=float, default=0.0)
    args = parser.parse_args()
    model = LM() if args.arch == "transformer" else GRULM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        tokens = torch.randint(0, 64, (8, 17))
        x, y = tokens[:, :-1], tokens[:, 1:]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
        scaler.scale(loss).backward()
        if args.clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")


if __name__ == "__main__":
    main()
