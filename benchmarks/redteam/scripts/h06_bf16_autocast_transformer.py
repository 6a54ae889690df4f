"""HEALTHY: small transformer LM with bfloat16 autocast and no GradScaler (the usual bf16
recipe). Embeddings are scaled by sqrt(d) and the loss is a mean over 32x64 tokens, so some
activations and many gradients would sit badly in float16, but bfloat16 has float32's range.
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class LM(nn.Module):
    def __init__(self, vocab=512, d=128, n=2):
        super().__init__()
        self.d = d
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        T = ids.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(T)
        x = self.embed(ids) * math.sqrt(self.d)
        return self.head(self.encoder(x, mask=causal, is_causal=True))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    model = LM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, 512, (8192,))
    data[1::2] = (data[0::2] * 3 + 1) % 512
    for step in range(args.steps):
        s = torch.randint(0, 8192 - 65, (32,))
        x = torch.stack([data[i:i + 64] for i in s])
        y = torch.stack([data[i + 1:i + 65] for i in s])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, 512).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
