"""Fails: Adam's eps=1e-8 is 0 in float16, and the model's parameters are float16 (.half()).

A small transformer language model converted with model.half() (no autocast, no fp32 master
weights) and trained with torch.optim.Adam at its default eps=1e-8. float16's smallest
subnormal is 2**-24 ~ 5.96e-8, so eps rounds to 0 when Adam adds it to sqrt(v) in float16.
Wherever v (the running mean of grad**2, with (1 - beta2) = 0.001) underflows to 0 while m does
not, m / (sqrt(v) + eps) divides by zero: the update is inf, the parameter becomes inf/NaN, in
the very first optimizer step, with no large gradient or update before.
--fixed eps uses eps=1e-4; --fixed master keeps fp32 weights and trains under autocast.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fixed", choices=["eps", "master"])
    args = parser.parse_args()

    model = TinyLM()
    if args.fixed != "master":
        model = model.half()
    eps = 1e-4 if args.fixed == "eps" else 1e-8
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    data = torch.randint(0, 64, (32, 13))

    for step in range(args.steps):
        batch = data[(step * 8) % 32:(step * 8) % 32 + 8]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=args.fixed == "master"):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 64), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
