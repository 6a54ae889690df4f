"""A torch.compile'd MLP trained a few steps (CPU).

    python compiled_mlp.py                          # inductor, float32, healthy
    python compiled_mlp.py --backend aot_eager --plant
        # autocast float16; step 3's batch is scaled by 1e5: the first Linear inside the
        # compiled module overflows float16
    python compiled_mlp.py --backend broken         # a backend whose compiled code makes NaN
        # from its 4th call on, while the module's own code stays finite (a compiler bug)

Prints ``step S loss X`` (every digit) and saves the final parameters to --save.
"""

import argparse

import torch
import torch.nn as nn


def broken_backend(gm, example_inputs):
    calls = [0]

    def run(*args):
        calls[0] += 1
        out = gm(*args)
        if calls[0] >= 4:  # what a miscompiled kernel would return
            out = [o * float("nan") if isinstance(o, torch.Tensor) else o for o in out] \
                if isinstance(out, (list, tuple)) else out * float("nan")
        return out

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--plant", action="store_true")
    parser.add_argument("--save", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    backend = broken_backend if args.backend == "broken" else args.backend
    cm = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 8, generator=g)
        y = torch.randn(16, 4, generator=g)
        if args.plant and step == 3:
            x = x * 1e5  # beyond float16's max once autocast casts it for the first Linear
        with torch.autocast("cpu", dtype=torch.float16, enabled=args.plant):
            loss = (cm(x).float() - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item()!r}", flush=True)
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
