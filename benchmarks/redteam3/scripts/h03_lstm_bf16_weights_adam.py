"""nn.LSTM sequence classifier (does the sequence end in token 1?), with the
model in bfloat16 (model.to(torch.bfloat16)) and Adam at lr 1.5e-4.

    python h03_lstm_bf16_weights_adam.py [--fp32] [--steps N] [--lr LR]
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--lr", type=float, default=1.5e-4)
a = ap.parse_args()
torch.manual_seed(0)
B, T, H = 64, 12, 64


class Clf(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(3, 16)
        s.lstm = nn.LSTM(16, H, batch_first=True)
        s.out = nn.Linear(H, 2)

    def forward(s, x):
        h, _ = s.lstm(s.emb(x))
        return s.out(h[:, -1])


model = Clf()
dt = torch.float32 if a.fp32 else torch.bfloat16
model.to(dt)
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    x = torch.randint(0, 3, (B, T), generator=g)
    y = (x[:, -1] == 1).long()
    loss = F.cross_entropy(model(x).float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
