"""Fails at step 2: a hand-written cross-entropy, ``-log(softmax(logits))``, outside every
module, under float16 autocast: the batch of step 2 is ten times larger, the logits' gaps pass
~17, softmax underflows to exactly 0 in float16 and log(0) is -inf. No module makes the
non-finite value (the model's logits are finite): only an op-level watch of the step names
``aten.log`` and this file's line. Prints ``step N loss X``."""

import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(6):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g) * (30.0 if step >= 2 else 1.0)
    y = torch.randint(0, 4, (16,), generator=g)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        probs = torch.softmax(model(x), dim=-1)
        loss = -torch.log(probs[torch.arange(16), y]).mean()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
