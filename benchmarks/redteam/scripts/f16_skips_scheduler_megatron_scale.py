"""Transformer classifier with fp16 autocast, GradScaler(init_scale=2**32) and a linear warm-up
LambdaLR stepped every iteration.

Reported pattern: the init_scale was copied from Megatron-LM's --initial-loss-scale default
(2^32). The scaled gradients overflow float16 for the first ~12 iterations, GradScaler skips
every one of them while halving the scale, and the scheduler, stepped every iteration anyway,
spends the whole 12-step warm-up on updates that never happened (torch warns "Detected call
of lr_scheduler.step() before optimizer.step()"). Training then starts at the peak learning
rate with no warm-up.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class TextClassifier(nn.Module):
    def __init__(self, vocab=3000, d=96, n_cls=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, n_cls)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=12)
    args = p.parse_args()
    model = TextClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 32)
    for step in range(args.steps):
        ids = torch.randint(0, 3000, (16, 40))
        y = ids[:, :5].sum(1) % 6
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(ids), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
              f"scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
