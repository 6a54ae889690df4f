"""HEALTHY: small ResNet-style CNN, fp16 autocast + GradScaler, linear warm-up then cosine decay;
the scheduler is stepped only on iterations where the optimizer really stepped (the scale did
not go down), as recommended, so calibration skips do not eat the warm-up.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


class Net(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(ResBlock(c), ResBlock(c))
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        return self.fc(self.blocks(F.relu(self.stem(x))).mean((2, 3)))


def main():
    protos = torch.randn(10, 3, 12, 12)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    warm, total = 5, 25
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / total)))
    scaler = torch.amp.GradScaler("cpu")
    for step in range(total):
        y = torch.randint(0, 10, (32,))
        x = protos[y] + 0.8 * torch.randn(32, 3, 12, 12)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        s0 = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() >= s0:
            sched.step()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f} lr {sched.get_last_lr()[0]:.3f}")


if __name__ == "__main__":
    main()
