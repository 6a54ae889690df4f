"""GRU intent classifier, fp16 autocast + GradScaler, with scaler.update() missing from the loop.

The loop was refactored to update the scale "once per epoch" and the per-step scaler.update()
was dropped. GradScaler requires update() after every step(): the second scaler.step() raises
"step() has already been called since the last update()" (and even without the error the scale
could never adapt to overflows).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
V = 300


class IntentGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, 64)
        self.gru = nn.GRU(64, 128, batch_first=True)
        self.cls = nn.Linear(128, 12)

    def forward(self, ids):
        _, h = self.gru(self.embed(ids))
        return self.cls(h[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    model = IntentGRU()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    ids_all = torch.randint(0, V, (512, 16))
    y_all = ids_all[:, :4].sum(1) % 12
    for step in range(a.steps):
        idx = torch.randint(0, 512, (32,))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(ids_all[idx]).float(), y_all[idx])
        scaler.scale(loss).backward()
        scaler.step(opt)
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")
    scaler.update()   # once per epoch


if __name__ == "__main__":
    main()
