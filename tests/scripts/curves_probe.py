"""An independent probe for the loss-curve scripts: runs one of them (``python curves_probe.py
curves_gpt.py --lr 1 ...``) with plain forward hooks of its own and prints, as JSON, per step:
the loss, each attention module's largest |logit| recomputed from its ``qkv`` projection's output
(q @ k^T / sqrt(head_dim), not from any softmax), and the head's largest |output|. No nanhunt.
"""

import json
import math
import runpy
import sys
from collections import defaultdict
from pathlib import Path

import curves_common

HEADS = 2


def main() -> None:
    script, argv = sys.argv[1], sys.argv[2:]
    rec: dict[str, dict[int, float]] = defaultdict(dict)
    step = [0]
    train = curves_common.train

    def hooked(args, model, batch, loss_fn=None):
        for name, module in model.named_modules():
            if name.endswith("attn.qkv"):
                attn = name.removesuffix(".qkv")

                def logits(mod, inp, out, name=attn):
                    b, t, d3 = out.shape
                    q, k, _ = out.detach().float().split(d3 // 3, -1)
                    q = q.view(b, t, HEADS, -1).transpose(1, 2)
                    k = k.view(b, t, HEADS, -1).transpose(1, 2)
                    att = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
                    rec[name][step[0]] = float(att.abs().amax())
                module.register_forward_hook(logits)
            if name in ("lm_head", "head"):

                def output(mod, inp, out, name=name):
                    rec[name][step[0]] = float(out.detach().float().abs().amax())
                module.register_forward_hook(output)
        import builtins

        real = builtins.print

        def count(*a, **k):
            text = " ".join(map(str, a))
            if text.startswith("step "):
                rec["loss"][step[0]] = float(text.split()[-1])
                step[0] += 1

        builtins.print = count
        try:
            train(args, model, batch, loss_fn)
        finally:
            builtins.print = real

    curves_common.train = hooked
    sys.argv = [script, *argv]
    runpy.run_path(str(Path(__file__).parent / script), run_name="__main__")
    print(json.dumps({k: {str(s): v for s, v in d.items()} for k, d in rec.items()}))


if __name__ == "__main__":
    main()
