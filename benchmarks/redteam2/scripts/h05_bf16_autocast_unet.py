"""HEALTHY: small UNet denoiser under bf16 autocast (no GradScaler needed: bf16 has fp32's
exponent range). Losses are noisier than fp32 but it trains.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def block(ci, co):
    return nn.Sequential(nn.Conv2d(ci, co, 3, padding=1), nn.GroupNorm(4, co), nn.SiLU(),
                         nn.Conv2d(co, co, 3, padding=1), nn.GroupNorm(4, co), nn.SiLU())


class UNet(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.d1, self.d2 = block(1, c), block(c, 2 * c)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.u1 = block(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        h1 = self.d1(x)
        return self.out(self.u1(torch.cat([self.up(self.d2(F.avg_pool2d(h1, 2))), h1], 1)))


def main():
    clean = torch.rand(64, 1, 16, 16).cumsum(-1).div(16)
    model = UNet()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for step in range(15):
        x = clean[(step % 4) * 16:(step % 4 + 1) * 16]
        noise = 0.2 * torch.randn_like(x)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(x + noise)
        loss = F.mse_loss(pred.float(), noise)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.5f}")


if __name__ == "__main__":
    main()
