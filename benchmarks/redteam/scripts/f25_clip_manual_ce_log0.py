"""Two-tower CLIP-style model (CNN image tower, GRU text tower) with a hand-written
contrastive cross-entropy, fp16 autocast + GradScaler.

Reported pattern: "loss is nan from the start only with AMP". CLIP's logit scale (100) makes
logit gaps above 17, so the fp16 softmax (CPU autocast keeps softmax in float16) rounds the
off-diagonal probabilities to exactly 0; log(0) = -inf and the one-hot target's zeros times
-inf give nan. (F.cross_entropy / log_softmax fixes it.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class ImageTower(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(3, 32, 3, 2, 1), nn.ReLU(), nn.Conv2d(32, 64, 3, 2, 1), nn.ReLU())
        self.proj = nn.Linear(64, d)

    def forward(self, img):
        return self.proj(self.conv(img).mean((2, 3)))


class TextTower(nn.Module):
    def __init__(self, vocab=500, d=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.proj = nn.Linear(d, d)

    def forward(self, ids):
        h, _ = self.rnn(self.embed(ids))
        return self.proj(h[:, -1])


class ContrastiveLoss(nn.Module):
    def __init__(self, logit_scale=100.0):
        super().__init__()
        self.logit_scale = logit_scale

    def forward(self, img_emb, txt_emb):
        img_emb = img_emb / img_emb.norm(dim=-1, keepdim=True)
        txt_emb = txt_emb / txt_emb.norm(dim=-1, keepdim=True)
        logits = self.logit_scale * img_emb @ txt_emb.t()
        target = torch.eye(len(logits), device=logits.device)
        p = logits.softmax(-1)
        return -(target * torch.log(p)).sum(-1).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    image_tower, text_tower = ImageTower(), TextTower()
    loss_fn = ContrastiveLoss()
    params = list(image_tower.parameters()) + list(text_tower.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    protos = torch.randn(500, 3, 16, 16)
    for step in range(args.steps):
        ids = torch.randint(0, 500, (16, 10))
        img = protos[ids[:, 0]] + 0.3 * torch.randn(16, 3, 16, 16)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(image_tower(img), text_tower(ids))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
