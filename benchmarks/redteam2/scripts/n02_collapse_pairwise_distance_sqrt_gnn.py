"""Distance-aware message-passing network (SchNet/EGNN style) on random point clouds, fp16
autocast + GradScaler, 30 steps.

Each layer embeds pairwise distances d_ij = sqrt(sum((x_i - x_j)^2)) over *all* pairs, including
i == j (the self-pair is masked out of the messages later, but it is computed). The forward
is finite (sqrt(0) = 0), but sqrt's backward at 0 is grad / (2 * 0) = inf, and the chain rule
through (x_i - x_i) = 0 makes it NaN in the coordinate gradient. The coordinates are refined by
a learned layer, so the NaN reaches every parameter each step: GradScaler skips all 30 steps
and the scale collapses to ~0. (The fix: sqrt(d2 + eps) or mask before the sqrt.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class DistanceLayer(nn.Module):
    def __init__(self, d=64, eps=0.0):
        super().__init__()
        self.rbf = nn.Linear(16, d)
        self.msg = nn.Sequential(nn.Linear(2 * d, d), nn.SiLU(), nn.Linear(d, d))
        self.centers = nn.Parameter(torch.linspace(0, 4, 16), requires_grad=False)
        self.eps = eps

    def forward(self, h, pos):
        diff = pos[:, :, None, :] - pos[:, None, :, :]             # (B, N, N, 3)
        dist = torch.sqrt((diff ** 2).sum(-1) + self.eps)          # includes i == j
        rbf = torch.exp(-(dist[..., None] - self.centers) ** 2)
        n = h.shape[1]
        pair = torch.cat([h[:, :, None].expand(-1, -1, n, -1), h[:, None].expand(-1, n, -1, -1)], -1)
        m = self.msg(pair) * self.rbf(rbf)
        off_diag = 1.0 - torch.eye(n)
        return h + (m * off_diag[None, :, :, None].to(m.dtype)).sum(2) / n


class PointNet(nn.Module):
    def __init__(self, n_types=5, d=64, eps=0.0):
        super().__init__()
        self.embed = nn.Embedding(n_types, d)
        self.refine = nn.Linear(3, 3)                  # learned coordinate refinement
        self.layers = nn.ModuleList(DistanceLayer(d, eps) for _ in range(2))
        self.out = nn.Linear(d, 1)

    def forward(self, z, pos):
        pos = pos + 0.1 * self.refine(pos)
        h = self.embed(z)
        for layer in self.layers:
            h = layer(h, pos)
        return self.out(h).mean((1, 2))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eps", type=float, default=0.0, help="1e-4 = the fix")
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    model = PointNet(eps=a.eps)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    z_all = torch.randint(0, 5, (256, 12))
    pos_all = torch.randn(256, 12, 3)
    energy = (z_all.float() - 2).sum(1) + torch.cdist(pos_all, pos_all).mean((1, 2))
    energy = (energy - energy.mean()) / energy.std()
    for step in range(a.steps):
        idx = torch.arange(step * 8, step * 8 + 8) % 256
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            pred = model(z_all[idx], pos_all[idx])
        loss = F.mse_loss(pred.float(), energy[idx])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.3g}")


if __name__ == "__main__":
    main()
