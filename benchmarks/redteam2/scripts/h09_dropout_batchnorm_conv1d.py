"""HEALTHY: 1D-conv audio-event classifier with BatchNorm1d and Dropout (train mode), fp16
autocast + GradScaler.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def main():
    model = nn.Sequential(
        nn.Conv1d(20, 32, 5, padding=2), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2),
        nn.Conv1d(32, 32, 5, padding=2), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(32, 6))
    templates = torch.randn(6, 20, 1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(20):
        y = torch.randint(0, 6, (32,))
        x = templates[y] + torch.randn(32, 20, 40)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
