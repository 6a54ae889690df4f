"""DLRM-style recommender (sparse embedding tables + dense bottom MLP + top MLP, no
normalisation), fp16 autocast + GradScaler, AdamW with lr=0.3 (the SGD learning rate from the
reference config, kept when switching to AdamW), clipping at 1.0 after unscale_.

AdamW moves every weight by ~lr per step regardless of the gradient's size, so clipping does
not help: the weight norms grow every step, the logits of the top MLP grow multiplicatively and
the forward overflows fp16 within a few steps (loss inf/NaN). --lr 1e-3 trains; --clip 0 diverges
as well.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def mlp(sizes):
    layers = []
    for i, o in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(i, o), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DLRM(nn.Module):
    def __init__(self, tables=(1000, 500, 200), d=16):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(n, d) for n in tables)
        self.bottom = mlp([13, 64, d])
        self.top = mlp([d * (len(tables) + 1) + 6, 128, 64, 1])

    def forward(self, dense, sparse):
        vs = [self.bottom(dense)] + [e(sparse[:, k]) for k, e in enumerate(self.emb)]
        z = torch.stack(vs, 1)
        inter = z @ z.transpose(1, 2)
        iu = torch.triu_indices(4, 4, 1)
        return self.top(torch.cat([torch.cat(vs, -1), inter[:, iu[0], iu[1]]], -1)).squeeze(-1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    n = 30000
    dense_all = torch.randn(n, 13)
    sparse_all = torch.stack([torch.randint(0, m, (n,)) for m in (1000, 500, 200)], 1)
    click = (torch.rand(n) < torch.sigmoid(dense_all[:, 0] + (sparse_all[:, 0] % 5 - 2).float())).float()
    model = DLRM()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    for step in range(a.steps):
        idx = torch.randint(0, n, (512,))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            logit = model(dense_all[idx], sparse_all[idx])
        loss = F.binary_cross_entropy_with_logits(logit.float(), click[idx])
        scaler.scale(loss).backward()
        if a.clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        scaler.step(opt)
        scaler.update()
        wn = sum(q.detach().float().norm() ** 2 for q in model.parameters()) ** 0.5
        print(f"step {step} loss {loss.item():.4g} |w| {wn:.4g} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
