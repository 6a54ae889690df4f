"""Keyword spotter: strided Conv1d front-end on raw toy audio (4 keywords) followed by a tanh
nn.RNN over the 64 frames, fp16 autocast + GradScaler on CPU, Adam. The recurrent matrix is
orthogonal with gain 2.5 to keep long-range information.

    python d03_conv_rnn_keyword_spotter.py [--fp32] [--clip C] [--gain G] [--steps N]
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--clip", type=float, default=0.0)
ap.add_argument("--gain", type=float, default=2.5)
ap.add_argument("--steps", type=int, default=25)
ap.add_argument("--lr", type=float, default=1e-3)
a = ap.parse_args()
torch.manual_seed(0)
K, B, T, H = 4, 16, 512, 48


class KWS(nn.Module):
    def __init__(s):
        super().__init__()
        s.front = nn.Sequential(nn.Conv1d(1, 16, 8, stride=8), nn.ReLU())
        s.rnn = nn.RNN(16, H, batch_first=True)
        nn.init.orthogonal_(s.rnn.weight_hh_l0, gain=a.gain)
        s.cls = nn.Linear(H, K)

    def forward(s, wav):
        f = s.front(wav[:, None]).transpose(1, 2)
        h, _ = s.rnn(f)
        return s.cls(h[:, -1])


model = KWS()
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)
g = torch.Generator().manual_seed(1)
t = torch.arange(T) / T
for step in range(a.steps):
    y = torch.randint(0, K, (B,), generator=g)
    env = (t < 0.25).float()  # the keyword is at the start of the clip
    wav = env * torch.sin(2 * 3.1416 * (20 + 15 * y[:, None]) * t) + 0.2 * torch.randn(B, T, generator=g)
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        loss = F.cross_entropy(model(wav).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    if a.clip:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
