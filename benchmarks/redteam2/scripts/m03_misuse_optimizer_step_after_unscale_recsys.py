"""Two-tower recommender (embeddings + MLP) trained with fp16 autocast + GradScaler, where the
loop calls optimizer.step() directly after scaler.unscale_() instead of scaler.step(optimizer).

Ported from a loop that clipped gradients: unscale_, clip, and then the author called
optimizer.step() (and scaler.update()). scaler.update() still lowers the scale after an
overflow, but nothing skips the overflowing step any more: the inf/NaN gradients of the first
(calibration) step are applied and every weight they touch becomes NaN.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class TwoTower(nn.Module):
    def __init__(self, n_users=2000, n_items=5000, d=64):
        super().__init__()
        self.user = nn.Embedding(n_users, d)
        self.item = nn.Embedding(n_items, d)
        self.user_mlp = nn.Sequential(nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, d))
        self.item_mlp = nn.Sequential(nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, d))

    def forward(self, u, i):
        return (self.user_mlp(self.user(u)) * self.item_mlp(self.item(i))).sum(-1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    model = TwoTower()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    u_all = torch.randint(0, 2000, (20000,))
    i_all = torch.randint(0, 5000, (20000,))
    rating = ((u_all % 7) == (i_all % 7)).float() * 4 + 1          # 1..5 stars
    for step in range(a.steps):
        idx = torch.randint(0, 20000, (512,))
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(u_all[idx], i_all[idx])
        loss = F.mse_loss(pred.float(), rating[idx])
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
