"""Small CNN image classifier (10 classes, synthetic 8x8 images), fp16 autocast + GradScaler
on CPU. The cross-entropy is written out by hand from the textbook formula:
probs = softmax(logits); loss = -(onehot * log(probs)).sum(1).mean().

    python b02_cnn_handwritten_cross_entropy.py [--fp32] [--fixed] [--steps N] [--lr LR]
--fixed uses F.cross_entropy(logits.float(), y).
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--fixed", action="store_true")
ap.add_argument("--steps", type=int, default=16)
ap.add_argument("--lr", type=float, default=1e-2)
a = ap.parse_args()
torch.manual_seed(0)
C, B = 10, 32
protos = torch.randn(C, 3, 8, 8)
g = torch.Generator().manual_seed(1)

model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(32 * 4, 128), nn.ReLU(), nn.Linear(128, C))
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)
for step in range(a.steps):
    y = torch.randint(0, C, (B,), generator=g)
    x = protos[y] * 2 + 0.5 * torch.randn(B, 3, 8, 8, generator=g)
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        logits = model(x)
        if a.fixed:
            loss = F.cross_entropy(logits.float(), y)
        else:
            probs = torch.softmax(logits, dim=1)
            loss = -(F.one_hot(y, C) * torch.log(probs)).sum(1).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
