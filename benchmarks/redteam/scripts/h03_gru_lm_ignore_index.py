"""HEALTHY: GRU language model on variable-length, right-padded sentences, fp16 autocast +
GradScaler; padded targets are -100 and ignored by F.cross_entropy(ignore_index=-100).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class GRULM(nn.Module):
    def __init__(self, vocab=400, d=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.proj_in = nn.Linear(d, d)
        self.gru = nn.GRU(d, d, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, ids):
        h, _ = self.gru(torch.tanh(self.proj_in(self.embed(ids))).float())
        return self.out(h)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    model = GRULM()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        lens = torch.randint(5, 30, (16,))
        ids = torch.randint(1, 400, (16, 30))
        ids[torch.arange(30)[None] >= lens[:, None]] = 0
        targets = ids[:, 1:].clone()
        targets[targets == 0] = -100
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 400), targets.reshape(-1), ignore_index=-100)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
