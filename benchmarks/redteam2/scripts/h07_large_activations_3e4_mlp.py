"""HEALTHY: MLP on features in the thousands (sensor counts, standardised *per batch* only after
the first layer), fp16 autocast + GradScaler. The first Linear's outputs reach ~3e4 (half of
fp16's 65504, but finite), a LayerNorm brings them back to O(1) and it trains. Large-but-finite
activations are not a failure.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 128)
        self.norm = nn.LayerNorm(128)
        self.body = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 3))

    def forward(self, x):
        return self.body(self.norm(self.inp(x)))


def main():
    base = torch.randn(4096, 16)
    x_all = 7000.0 * base + 8000.0                    # raw counts, up to ~4e4
    y_all = (base[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(1)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(25):
        idx = torch.randint(0, 4096, (128,))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            h = model.inp(x_all[idx])
            logits = model.body(model.norm(h))
        loss = F.cross_entropy(logits.float(), y_all[idx])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} amax(inp) {h.abs().max().item():.0f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
