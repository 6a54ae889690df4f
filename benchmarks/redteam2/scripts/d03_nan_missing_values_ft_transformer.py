"""FT-Transformer-style tabular classifier (one token per numeric feature), fp16 autocast +
GradScaler. Missing values in the CSV were read as NaN and not imputed.

The first batches happen to have no missing values; from step 3 on, rows with a missing
'income' field (NaN) enter the batch. The NaN comes from the data, not from any op: the
feature tokenizer propagates it, the loss is NaN and GradScaler skips every later step.
(Imputing with nan_to_num / the column median, --impute, trains.)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
N_FEAT = 8


class FTTransformer(nn.Module):
    def __init__(self, d=32, n_cls=2):
        super().__init__()
        self.w = nn.Parameter(torch.randn(N_FEAT, d) * 0.1)     # per-feature tokenizer
        self.b = nn.Parameter(torch.zeros(N_FEAT, d))
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, n_cls)

    def forward(self, x):
        tok = x[..., None] * self.w + self.b
        tok = torch.cat([self.cls.expand(x.shape[0], -1, -1), tok], 1)
        return self.head(self.encoder(tok)[:, 0])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--impute", action="store_true")
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    a = p.parse_args()
    fp16 = a.precision == "fp16"
    X = torch.randn(2048, N_FEAT)
    y = (X[:, 0] + X[:, 1] * X[:, 2] > 0).long()
    X[384:][torch.rand(2048 - 384) < 0.05, 3] = float("nan")   # missing 'income' (later rows)
    if a.impute:
        X = torch.nan_to_num(X, nan=0.0)
    model = FTTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    for step in range(a.steps):
        xb, yb = X[step * 128:(step + 1) * 128], y[step * 128:(step + 1) * 128]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            logits = model(xb)
        loss = F.cross_entropy(logits.float(), yb)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
