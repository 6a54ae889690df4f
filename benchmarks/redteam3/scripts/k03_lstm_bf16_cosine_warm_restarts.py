"""nn.LSTM language model on a synthetic repeating-pattern corpus, bf16 autocast on CPU, AdamW
with CosineAnnealingWarmRestarts(T_0=8): the learning rate jumps back up every 8 steps.

    python k03_lstm_bf16_cosine_warm_restarts.py [--fp32] [--steps N] [--lr LR]
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--steps", type=int, default=32)
ap.add_argument("--lr", type=float, default=1e-2)
a = ap.parse_args()
torch.manual_seed(0)
V, H, T, B = 16, 64, 32, 16


class LM(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(V, 32)
        s.lstm = nn.LSTM(32, H, batch_first=True)
        s.out = nn.Linear(H, V)

    def forward(s, x):
        h, _ = s.lstm(s.emb(x))
        return s.out(h)


model = LM()
opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=8)
g = torch.Generator().manual_seed(1)
pattern = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8])
for step in range(a.steps):
    off = torch.randint(0, 12, (B, 1), generator=g)
    seq = pattern[(off + torch.arange(T + 1)) % 12]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not a.fp32):
        loss = F.cross_entropy(model(seq[:, :-1]).float().reshape(-1, V), seq[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
