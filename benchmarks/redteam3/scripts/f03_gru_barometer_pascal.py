"""Weather nowcasting: a GRU predicts the next-hour temperature from station readings
(temperature in C, humidity in %, pressure in Pa as logged), fp16 autocast + GradScaler on CPU.
A Linear encoder feeds the GRU.

    python f03_gru_barometer_pascal.py [--fp32] [--normalize] [--steps N]
--normalize standardises every input column with training-set statistics.
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--normalize", action="store_true")
ap.add_argument("--steps", type=int, default=15)
ap.add_argument("--lr", type=float, default=3e-3)
a = ap.parse_args()
torch.manual_seed(0)
B, T = 32, 24
g = torch.Generator().manual_seed(1)
hours = torch.arange(T + 1).float()
ph = torch.rand(256, 1, generator=g) * 6.28
temp = 12 + 6 * torch.sin(hours / 24 * 6.28 + ph) + 0.3 * torch.randn(256, T + 1, generator=g)
hum = 70 - 2 * (temp - 12) + torch.randn(256, T + 1, generator=g)
pres = 101325 + 300 * torch.randn(256, 1, generator=g) + 20 * torch.randn(256, T + 1, generator=g)
feats = torch.stack([temp, hum, pres], -1)[:, :-1]
target = temp[:, 1:]
if a.normalize:
    feats = (feats - feats.mean((0, 1))) / feats.std((0, 1))


class Nowcast(nn.Module):
    def __init__(s):
        super().__init__()
        s.enc = nn.Linear(3, 32)
        s.gru = nn.GRU(32, 32, batch_first=True)
        s.head = nn.Linear(32, 1)

    def forward(s, x):
        h, _ = s.gru(torch.relu(s.enc(x)))
        return s.head(h).squeeze(-1)


model = Nowcast()
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)
for step in range(a.steps):
    i = torch.randint(0, 256, (B,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        loss = F.mse_loss(model(feats[i]).float(), target[i])
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
