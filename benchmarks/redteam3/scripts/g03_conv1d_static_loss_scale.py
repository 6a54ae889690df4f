"""1D-conv speaker classifier on toy 8 kHz clips, pure fp16 model (model.half()) with a manual
static loss scale copied from an old apex-era recipe: (loss * 65536).backward(), then every
gradient is divided by 65536 before an SGD step on fp32 master weights. The loss is summed over the batch.

    python g03_conv1d_static_loss_scale.py [--fp32] [--scale S] [--steps N] [--lr LR]
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--scale", type=float, default=65536.0)
ap.add_argument("--steps", type=int, default=15)
ap.add_argument("--lr", type=float, default=0.003)
a = ap.parse_args()
torch.manual_seed(0)
K, B, T = 4, 16, 512
model = nn.Sequential(nn.Conv1d(1, 16, 16, stride=8), nn.ReLU(),
                      nn.Conv1d(16, 32, 5, stride=2), nn.ReLU(),
                      nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(32, K))
master = [p.detach().clone().float() for p in model.parameters()]
dtype = torch.float32 if a.fp32 else torch.float16
model.to(dtype)
opt = torch.optim.SGD(master, lr=a.lr, momentum=0.9)
g = torch.Generator().manual_seed(1)
t = torch.arange(T) / 8000
for step in range(a.steps):
    y = torch.randint(0, K, (B,), generator=g)
    wav = torch.sin(2 * 3.1416 * (200 + 150 * y[:, None]) * t) + 0.3 * torch.randn(B, T, generator=g)
    loss = F.cross_entropy(model(wav[:, None].to(dtype)).float(), y, reduction="sum")
    model.zero_grad()
    (loss * a.scale).backward()
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.float() / a.scale
    opt.step()
    with torch.no_grad():
        for m, p in zip(master, model.parameters()):
            p.copy_(m)
    print(f"step {step} loss {loss.item():.4f}", flush=True)
