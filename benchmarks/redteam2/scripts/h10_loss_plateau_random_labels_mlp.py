"""HEALTHY (not a numerical failure): an MLP on labels that are pure noise, fp16 autocast +
GradScaler. Nothing can be learned, so the loss plateaus at ~log(10) = 2.30 from the start;
every value is finite and every step is applied. A plateau is not a NaN/overflow problem.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def main():
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(25):
        x = torch.randn(256, 32)
        y = torch.randint(0, 10, (256,))                  # labels independent of x
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
