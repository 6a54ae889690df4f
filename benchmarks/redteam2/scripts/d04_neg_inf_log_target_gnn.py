"""Molecular-property GNN (message passing over a dense adjacency) regressing log-solubility,
fp16 autocast + GradScaler. The targets are computed as log(solubility) during preprocessing,
and some compounds were recorded with solubility 0 (below the detection limit).

log(0) = -inf in the target of those molecules (here in the batch of step 5): the prediction is
finite, the MSE against -inf is inf, the loss is inf and its gradient NaN. The bad value is in
the data, made before training by the preprocessing, not by the model. (Clamping the
solubility at the detection limit, --clamp, trains.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class MPNN(nn.Module):
    def __init__(self, n_atom=10, d=64, layers=3):
        super().__init__()
        self.atom = nn.Embedding(n_atom, d)
        self.msg = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.upd = nn.ModuleList(nn.Linear(2 * d, d) for _ in range(layers))
        self.readout = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, z, adj):
        h = self.atom(z)
        for m, u in zip(self.msg, self.upd):
            agg = adj.to(h.dtype) @ m(h)
            h = h + torch.relu(u(torch.cat([h, agg.to(h.dtype)], -1)))
        return self.readout(h.mean(1)).squeeze(-1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--clamp", action="store_true")
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    n_mol, n_at = 768, 16
    z = torch.randint(0, 10, (n_mol, n_at))
    adj = (torch.rand(n_mol, n_at, n_at) < 0.15).float()
    adj = ((adj + adj.transpose(1, 2)) > 0).float()
    solubility = torch.exp((z == 3).float().sum(1) * 0.3 - 2 + 0.2 * torch.randn(n_mol))
    solubility[[333, 345, 700]] = 0.0                       # below detection limit
    if a.clamp:
        solubility = solubility.clamp(min=1e-3)
    target = torch.log(solubility)                           # preprocessing
    model = MPNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    for step in range(a.steps):
        sl = slice(step * 64, (step + 1) * 64)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            pred = model(z[sl], adj[sl])
        loss = F.mse_loss(pred.float(), target[sl])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
