"""Transformer LM with the token loss summed instead of averaged (reduction="sum"), fp16 autocast
+ default GradScaler, and a 5-step linear warm-up scheduler stepped on every iteration.

Copied from a seq2seq codebase that normalises by the number of tokens later (and then dropped
the normalisation). The summed CE over 32x64 tokens is ~1.3e4; dL/dlogits is O(1) per token and the
weight gradients sum over all tokens, so at the default 2^16 scale nearly every backward
overflows: GradScaler halves the scale on most steps and keeps skipping long after the usual
calibration: the first 5 steps are all skipped while sched.step() still advances, so the whole
warm-up is spent on updates that never happened (torch warns that lr_scheduler.step() ran
before optimizer.step()), and the first real update already uses the peak lr. The model itself
is fine (the unscaled gradients fit fp16); reduction="mean" trains with no skips.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
V, T = 512, 64


class LM(nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.pos = nn.Embedding(T, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(d, V)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.out(self.blocks(h, mask=mask, is_causal=True))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--reduction", default="sum", choices=["sum", "mean"])
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    data = torch.randint(0, V, (256, T + 1))
    data[:, 1:] = torch.where(torch.rand(256, T) < 0.7, (data[:, :-1] * 5 + 3) % V, data[:, 1:])
    model = LM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    skipped = 0
    for step in range(a.steps):
        b = data[(step % 8) * 32:(step % 8 + 1) * 32]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            logits = model(b[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, V), b[:, 1:].reshape(-1),
                               reduction=a.reduction)
        scaler.scale(loss).backward()
        s0 = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        sched.step()
        skipped += scaler.get_scale() < s0
        print(f"step {step} loss/token {loss.item() / (b.numel() - 32 if a.reduction == 'sum' else 1):.4f} "
              f"scale {scaler.get_scale():.0f} skipped {skipped} lr {sched.get_last_lr()[0]:.1e}")


if __name__ == "__main__":
    main()
