"""HEALTHY: two-tower recommender, fp16 autocast + GradScaler with gradient accumulation over 4
micro-batches (loss / 4, one unscale_/clip/step/update per optimizer step).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class TwoTower(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.user = nn.Embedding(1000, d)
        self.item = nn.Embedding(2000, d)
        self.u_mlp = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, d))
        self.i_mlp = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, d))

    def forward(self, u, i):
        return (self.u_mlp(self.user(u)) * self.i_mlp(self.item(i))).sum(-1)


def main():
    u_all = torch.randint(0, 1000, (20000,))
    i_all = torch.randint(0, 2000, (20000,))
    click = ((u_all % 5) == (i_all % 5)).float()
    model = TwoTower()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    accum = 4
    for step in range(15):
        opt.zero_grad()
        total = 0.0
        for _ in range(accum):
            idx = torch.randint(0, 20000, (128,))
            with torch.autocast("cpu", dtype=torch.float16):
                logit = model(u_all[idx], i_all[idx])
            loss = F.binary_cross_entropy_with_logits(logit.float(), click[idx]) / accum
            scaler.scale(loss).backward()
            total += loss.item()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {total:.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
