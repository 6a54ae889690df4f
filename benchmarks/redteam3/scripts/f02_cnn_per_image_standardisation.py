"""Small CNN defect classifier on 8x8 grey-scale inspection crops, bf16 autocast on CPU, Adam.
Each crop is standardised on its own in the data pipeline: (x - x.mean()) / x.std().
Some crops come from a camera that sometimes returns a saturated (all-white) frame.

    python f02_cnn_per_image_standardisation.py [--fp32] [--fixed] [--steps N]
--fixed uses (x - mean) / (std + 1e-6).
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--fixed", action="store_true")
ap.add_argument("--steps", type=int, default=15)
ap.add_argument("--lr", type=float, default=3e-3)
a = ap.parse_args()
torch.manual_seed(0)
B = 32
g = torch.Generator().manual_seed(1)
model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(16, 2))
opt = torch.optim.Adam(model.parameters(), lr=a.lr)


def load_batch(step):
    y = torch.randint(0, 2, (B,), generator=g)
    img = torch.rand(B, 1, 8, 8, generator=g) * 0.3 + 0.3
    img[y == 1, :, 3:5, :] += 0.4  # scratch
    if step == 5:
        img[11] = 1.0  # saturated frame
    mean = img.mean((1, 2, 3), keepdim=True)
    std = img.std((1, 2, 3), keepdim=True)
    return ((img - mean) / (std + 1e-6) if a.fixed else (img - mean) / std), y


for step in range(a.steps):
    x, y = load_batch(step)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not a.fp32):
        loss = F.cross_entropy(model(x).float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
