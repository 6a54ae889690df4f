"""1D-conv keyword-spotting model (no normalisation layers) on log-mel features, fp16 autocast +
GradScaler, Adam with lr=0.3 (meant 3e-4) and gradient clipping at 1.0 after unscale_.

Adam's per-weight step is ~lr whatever the gradient norm, so clipping does not slow it down:
every conv weight moves by ~0.3 per step, the weights' norms grow step after step and, with no
normalisation, the activations grow like the product of the layers' gains until the forward
overflows fp16 and the loss is inf/NaN. --lr 3e-4 trains; --clip 0 diverges the same way.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class KWS(nn.Module):
    def __init__(self, n_mels=40, c=32, n_cls=12):
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv1d(n_mels, c, 3, padding=1), nn.ReLU(),
            nn.Conv1d(c, c, 3, padding=1), nn.ReLU(),
            nn.Conv1d(c, c, 3, padding=1), nn.ReLU(),
            nn.Conv1d(c, c, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(c, n_cls)

    def forward(self, x):
        return self.fc(self.convs(x).mean(-1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    templates = torch.randn(12, 40, 1) * 2
    model = KWS()
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    for step in range(a.steps):
        y = torch.randint(0, 12, (32,))
        x = templates[y] + torch.randn(32, 40, 50)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        scaler.scale(loss).backward()
        if a.clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        scaler.step(opt)
        scaler.update()
        wn = sum(q.detach().float().norm() ** 2 for q in model.parameters()) ** 0.5
        print(f"step {step} loss {loss.item():.4g} |w| {wn:.3g} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
