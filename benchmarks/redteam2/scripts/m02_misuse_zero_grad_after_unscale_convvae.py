"""Conv VAE on 28x28 images, fp16 autocast + GradScaler, with optimizer.zero_grad() placed
between scaler.unscale_() and scaler.step().

The zero_grad call was moved "to the end of the step" but landed after unscale_ (which was
there for gradient-norm logging). scaler.step() then sees gradients that were already cleared
(set to None): the optimizer never updates anything, no error, no warning. The loss stays flat;
with the zero_grad at the top of the loop (--fixed) the VAE trains.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class ConvVAE(nn.Module):
    def __init__(self, z=16):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 16, 4, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 4, 2, 1),
                                 nn.ReLU(), nn.Flatten())
        self.mu = nn.Linear(32 * 7 * 7, z)
        self.logvar = nn.Linear(32 * 7 * 7, z)
        self.dec_in = nn.Linear(z, 32 * 7 * 7)
        self.dec = nn.Sequential(nn.ConvTranspose2d(32, 16, 4, 2, 1), nn.ReLU(),
                                 nn.ConvTranspose2d(16, 1, 4, 2, 1))

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        zs = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(self.dec_in(zs).view(-1, 32, 7, 7)), mu, logvar


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--fixed", action="store_true")
    a = p.parse_args()
    model = ConvVAE()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    imgs = (torch.rand(256, 1, 28, 28).cumsum(-1) / 14 > 1).float()   # blobby binary images
    for step in range(a.steps):
        x = imgs[(step % 16) * 16:(step % 16 + 1) * 16]
        if a.fixed:
            opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits, mu, logvar = model(x)
        rec = F.binary_cross_entropy_with_logits(logits.float(), x, reduction="sum") / x.shape[0]
        kl = -0.5 * torch.sum(1 + logvar.float() - mu.float() ** 2 - logvar.float().exp()) / x.shape[0]
        loss = rec + kl
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gnorm = torch.nn.utils.get_total_norm([q.grad for q in model.parameters() if q.grad is not None])
        if not a.fixed:
            opt.zero_grad()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.2f} grad_norm {gnorm:.3g} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
