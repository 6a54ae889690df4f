"""Tanh nn.RNN on a delayed-recall task (remember the first token for 60 steps), fp16 autocast
+ GradScaler on CPU. To fight vanishing gradients over the long sequence, the recurrent matrix
is initialised orthogonal with gain 3.

    python d01_tanh_rnn_orthogonal_gain_copy.py [--fp32] [--clip C] [--gain G] [--steps N]
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--clip", type=float, default=0.0)
ap.add_argument("--gain", type=float, default=3.0)
ap.add_argument("--steps", type=int, default=25)
ap.add_argument("--lr", type=float, default=1e-3)
a = ap.parse_args()
torch.manual_seed(0)
V, H, T, B = 8, 64, 60, 32


class Recall(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(V, H)
        s.rnn = nn.RNN(H, H, batch_first=True, nonlinearity="tanh")
        nn.init.orthogonal_(s.rnn.weight_hh_l0, gain=a.gain)
        s.out = nn.Linear(H, V)

    def forward(s, x):
        h, _ = s.rnn(s.emb(x))
        return s.out(h[:, -1])


model = Recall()
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=not a.fp32)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    x = torch.randint(0, V, (B, T), generator=g)
    y = x[:, 0]
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        loss = F.cross_entropy(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    if a.clip:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
