"""HEALTHY: tanh nn.RNN character LM (orthogonal recurrent init), fp16 autocast + GradScaler,
gradient clipping done right: scaler.unscale_(opt) -> clip_grad_norm_ -> scaler.step ->
scaler.update.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
V, T = 64, 50


class CharRNN(nn.Module):
    def __init__(self, hidden=128):
        super().__init__()
        self.embed = nn.Embedding(V, 32)
        self.rnn = nn.RNN(32, hidden, batch_first=True)
        nn.init.orthogonal_(self.rnn.weight_hh_l0)
        self.decoder = nn.Linear(hidden, V)

    def forward(self, ids):
        return self.decoder(self.rnn(self.embed(ids))[0])


def main():
    text = torch.randint(0, V, (20000,))
    text = torch.where(torch.rand(20000) < 0.6, (torch.roll(text, 1) * 3 + 1) % V, text)
    model = CharRNN()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(30):
        starts = torch.randint(0, 20000 - T - 1, (32,))
        chunk = torch.stack([text[s:s + T + 1] for s in starts])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, V), chunk[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} grad_norm {gn:.3g} scale {scaler.get_scale():.0f}")


if __name__ == "__main__":
    main()
