"""1D-conv TTS postnet (three Conv1d layers, 40 mel bins) trained to predict the residual between
a coarse and the true normalised log-mel spectrogram, fp16 autocast on CPU without GradScaler.
The loss is the MSE, normalised per frame of the batch ("loss per frame"): mse(pred, target) / (batch * n_frames).

    python c03_conv1d_tts_postnet_per_frame.py [--fp32] [--scaler] [--steps N] [--lr LR]
--scaler adds torch.amp.GradScaler.
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--scaler", action="store_true")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--lr", type=float, default=2e-3)
a = ap.parse_args()
torch.manual_seed(0)
B, M, T = 2, 40, 400

postnet = nn.Sequential(
    nn.Conv1d(M, 32, 5, padding=2), nn.Tanh(),
    nn.Conv1d(32, 32, 5, padding=2), nn.Tanh(),
    nn.Conv1d(32, M, 5, padding=2))
opt = torch.optim.Adam(postnet.parameters(), lr=a.lr)
scaler = torch.amp.GradScaler("cpu", enabled=a.scaler and not a.fp32)
g = torch.Generator().manual_seed(1)
mix = torch.randn(M, M, generator=g) / M ** 0.5
for step in range(a.steps):
    mel = torch.randn(B, M, T, generator=g).cumsum(-1) / 20
    coarse = mel + 0.5 * torch.tanh(torch.einsum("nm,bmt->bnt", mix, mel))
    with torch.autocast("cpu", dtype=torch.float16, enabled=not a.fp32):
        res = postnet(coarse)
        loss = F.mse_loss(res.float(), mel - coarse) / (B * T)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4e}", flush=True)
