"""HEALTHY: GRU sensor regressor, fp16 autocast + default GradScaler (init_scale 2^16).

The first steps overflow at 2^16 and GradScaler skips them while it calibrates the scale; after
that every step is applied and the loss falls. A few skips at the start are normal.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(4, 64, batch_first=True)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        h, _ = self.gru(x)
        return self.head(h[:, -1]).squeeze(-1)


def main():
    x_all = torch.randn(2048, 30, 4)
    y_all = 3 * x_all[:, -5:, 0].mean(1) + 4            # engineering units, ~4 +- 1.3
    model = Regressor()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(30):
        idx = torch.randint(0, 2048, (64,))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x_all[idx])
        loss = F.mse_loss(pred.float(), y_all[idx])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.3f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
