"""Precision loss without NaN: linear attention whose running sums accumulate in float16.

A one-block transformer with a linear-attention token mixer in its recurrent form: the state
S_t = S_{t-1} + phi(k_t) v_t^T and the normaliser z_t = z_{t-1} + phi(k_t) are summed one
position at a time, under torch.autocast("cpu", float16) + GradScaler. The normaliser carries
the count of earlier segments (4096 tokens, Transformer-XL style): it is 2^12 times an addend
from the first token on, and float16 (11 significant bits) rounds the addends away
(swamping). Nothing is non-finite; `nanhunt audit` should rank `block.mixer` first and advise
float32 for it.
Modules: "" (Net), "embed", "block" (Block), "block.q", "block.k", "block.v",
"block.mixer" (RecurrentLinearAttention), "block.norm", "head".
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class RecurrentLinearAttention(nn.Module):
    memory = 4096.0  # tokens of earlier segments already summed into the normaliser

    def forward(self, q, k, v):
        fq, fk = F.elu(q) + 1, F.elu(k) + 1
        s = torch.zeros(q.shape[0], q.shape[2], v.shape[2], dtype=v.dtype)
        z = torch.full((q.shape[0], q.shape[2]), self.memory, dtype=fk.dtype)
        outs = []
        for t in range(q.shape[1]):
            s = s + fk[:, t, :, None] * v[:, t, None, :]
            z = z + fk[:, t]
            num = (fq[:, t, :, None] * s).sum(1)
            outs.append(num / (fq[:, t] * z).sum(1, keepdim=True))
        return torch.stack(outs, 1)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.mixer = RecurrentLinearAttention()
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.mixer(self.q(x), self.k(x), self.v(x)))


class Net(nn.Module):
    def __init__(self, vocab=32, d=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.block = Block(d)
        self.head = nn.Linear(d, vocab)
        nn.init.normal_(self.head.weight, std=1.0)  # confident logits: the loss feels the mixer

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        ids = torch.randint(0, 32, (2, 513))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
