"""Image-retrieval CNN with hand-written GeM pooling (generalised mean, p=3) without the usual
clamp(min=eps), fp16 autocast + GradScaler, 8-step fine-tune.

GeM(x) = mean(x^p)^(1/p). After the last ReLU some channels are exactly zero over the whole
feature map (dead channels), so mean(x^p) = 0 and the backward of pow(., 1/p) at 0 is
(1/p) * 0^(1/p - 1) = inf; times the zero from the p-th power it becomes NaN. The forward is
finite (0^(1/3) = 0). Every step's gradients are NaN, GradScaler skips every step and halves
the scale: the model never trains. (Radenovic et al. clamp at eps=1e-6 for this reason; --eps 1e-6 trains. The NaN is not an
fp16 effect: --precision fp32 gives loss nan from step 1.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class GeM(nn.Module):
    def __init__(self, p=3.0, eps=0.0):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(p))
        self.eps = eps

    def forward(self, x):
        if self.eps:
            x = x.clamp(min=self.eps)
        return x.pow(self.p).mean((-2, -1)).pow(1.0 / self.p)   # default: no clamp(min=eps)


class RetrievalNet(nn.Module):
    def __init__(self, dim=128, eps=0.0):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 128, 3, 2, 1), nn.ReLU())
        with torch.no_grad():
            self.backbone[6].bias[::3] = -4.0   # pre-trained weights: a third of the channels are dead
        self.pool = GeM(eps=eps)
        self.proj = nn.Linear(128, dim)

    def forward(self, x):
        return F.normalize(self.proj(self.pool(self.backbone(x))), dim=-1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eps", type=float, default=0.0, help="1e-6 = the fix")
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    model = RetrievalNet(eps=a.eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    protos = torch.randn(10, 3, 16, 16)
    for step in range(a.steps):
        cls = torch.randint(0, 10, (32,))
        x = protos[cls] + 0.5 * torch.randn(32, 3, 16, 16)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            e = model(x)
            e2 = model(protos[cls] + 0.5 * torch.randn(32, 3, 16, 16))
        sim = e.float() @ e2.float().T / 0.1
        loss = F.cross_entropy(sim, torch.arange(32))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
