"""GRU document classifier with additive attention pooling over the GRU states, fp16 autocast +
GradScaler; padded time steps are masked with masked_fill(mask, -1e9).

The attention scores come from a Linear under autocast, so they are float16; -1e9 does not fit
fp16 (max 65504) and masked_fill raises "value cannot be converted to type c10::Half without
overflow" in the pooling module on the first batch. (float('-inf') or
torch.finfo(scores.dtype).min works; --precision fp32 runs.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
V = 2000


class AttnPool(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.v = nn.Linear(d, 1, bias=False)

    def forward(self, h, pad):
        scores = self.v(torch.tanh(self.proj(h))).squeeze(-1)
        scores = scores.masked_fill(pad, -1e9)
        w = torch.softmax(scores, -1)
        return (w.unsqueeze(-1) * h).sum(1)


class DocClassifier(nn.Module):
    def __init__(self, d=64, n_cls=4):
        super().__init__()
        self.embed = nn.Embedding(V, d, padding_idx=0)
        self.gru = nn.GRU(d, d, batch_first=True, bidirectional=True)
        self.pool = AttnPool(2 * d)
        self.out = nn.Linear(2 * d, n_cls)

    def forward(self, ids):
        h, _ = self.gru(self.embed(ids))
        return self.out(self.pool(h, ids == 0))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    model = DocClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    for step in range(a.steps):
        lens = torch.randint(5, 40, (32,))
        ids = torch.randint(1, V, (32, 40)) * (torch.arange(40) < lens[:, None])
        y = (ids[:, :3] < 400).sum(1)                      # 0..3 "keyword" tokens in the title
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            logits = model(ids)
        loss = F.cross_entropy(logits.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
