"""Mixture-of-experts MLP classifier, fp16 autocast + GradScaler(growth_interval=1).

Someone "tuned" GradScaler to recover the scale faster: growth_interval=1 doubles the scale
after every clean step. Once calibrated, the next doubling overflows, the step is skipped and
the scale halves again, so about every second step is thrown away for the whole run (the
default growth_interval=2000 skips only during calibration; see h01). Half the compute is
wasted and training is ~2x slower.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class MoE(nn.Module):
    def __init__(self, d=64, n_exp=4, hidden=256):
        super().__init__()
        self.gate = nn.Linear(d, n_exp)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)) for _ in range(n_exp))

    def forward(self, x):
        w = F.softmax(self.gate(x).float(), -1)                     # (B, E)
        top = w.topk(2, -1)
        out = torch.zeros_like(x)
        for k in range(2):
            for e, expert in enumerate(self.experts):
                sel = top.indices[:, k] == e
                if sel.any():
                    out[sel] = out[sel] + top.values[sel, k:k + 1].to(out.dtype) * expert(x[sel]).to(out.dtype)
        return x + out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(20, 64)
        self.moe1, self.moe2 = MoE(), MoE()
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        return self.head(self.moe2(self.moe1(self.inp(x))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--growth-interval", type=int, default=1)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    x_all = torch.randn(4096, 20)
    y_all = (x_all[:, :8] * 3 + x_all[:, 8:16].pow(2)).argmax(1)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu", growth_interval=a.growth_interval, enabled=fp16)
    skipped = 0
    for step in range(a.steps):
        idx = torch.randint(0, 4096, (256,))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            logits = model(x_all[idx])
        loss = F.cross_entropy(logits.float(), y_all[idx])
        scaler.scale(loss).backward()
        s0 = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < s0
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f} skipped {skipped}")


if __name__ == "__main__":
    main()
