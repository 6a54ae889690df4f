"""Failures without a NaN in three architectures, with healthy controls (issue 23): the full
matrix the test suite keeps a subset of (tests/integration/test_curves_cli.py).

Run from the repository root::

    python benchmarks/curves_matrix.py              # every case, about 2 CLI runs a case
    python benchmarks/curves_matrix.py --only gpt   # one architecture
    python benchmarks/curves_matrix.py --json out.json

For each architecture (tests/scripts/curves_gpt.py: a GPT-style LM, curves_vit.py: a ViT,
curves_encoder.py: a bidirectional encoder) and each pattern it runs ``nanhunt diagnose`` on the
failing script and checks the exit code, the rule, the kind and the module against an
independent probe (tests/scripts/curves_probe.py: plain forward hooks that recompute the
attention logits from each ``qkv`` projection and read the head's output); then it applies the
fix by hand (the script's own flag: ``--qk-norm``, ``--z-loss``, a lower ``--lr``, a warm-up,
float32 weights) and checks that the copy trains: exit 0 under nanhunt and a lower final loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
ARCHS = {"gpt": "curves_gpt.py", "vit": "curves_vit.py", "encoder": "curves_encoder.py"}
HEAD = {"gpt": "lm_head", "vit": "head", "encoder": "head"}

# name -> (script args, expected rule, kind, signal the probe checks, the fix by hand)
PATTERNS = {
    "attention-logits": (["--hot", "qkv", "--hot-lr", "1"], "logit-growth", "logit_growth",
                         "attention", ["--qk-norm"]),
    "output-logits": (["--hot", "{head}", "--hot-lr", "10"], "logit-growth", "logit_growth",
                      "head", ["--hot-lr", "0.003"]),
    # the loss's divergence (by the rule, or by the control and the lr rungs), or the weights'
    # growth under the updates that makes it (the same kind and fix: a lower lr)
    "lr-far-too-high": (["--lr", "1"], ("loss-divergence", "experiment-divergence",
                                        "weight-growth"),
                        "lr_too_high", None, ["--lr", "1e-3"]),
    "post-ln-no-warmup": (["--post-ln", "--depth", "4", "--lr", "0.03"], "post-ln-warmup",
                          "lr_too_high", None, ["--warmup", "20"]),
    "stall-bf16-weights": (["--weights", "bf16", "--lr", "3e-4", "--steps", "40"], "loss-stall",
                           "underflow", None, ["--weights", "fp32"]),
}
# healthy controls: exit 0, no error; a recovering spike may be a warning with its step
CONTROLS = {
    "recovering-spike": {"gpt": ["--spike-at", "15", "--spike-lr", "100"],
                         "vit": ["--spike-at", "15", "--spike-lr", "5"],
                         "encoder": ["--spike-at", "15", "--spike-lr", "10"]},
    "scaler-growth-2": ["--precision", "fp16", "--growth-interval", "2", "--steps", "40"],
    "scaler-growth-7": ["--precision", "fp16", "--growth-interval", "7", "--steps", "40"],
    "cosine-restarts": ["--lr", "0.01", "--restarts", "8", "--steps", "40"],
    "warmup": ["--lr", "0.01", "--warmup", "10"],
}


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def diagnose(script: str, args: list[str], out: Path, verify: int = 0
             ) -> tuple[int, dict, list[float]]:
    proc = subprocess.run([sys.executable, "-m", "nanhunt", "diagnose", "--verify", str(verify),
                           "--quiet", "--out", str(out), str(SCRIPTS / script), *args],
                          capture_output=True, text=True, env=env(), timeout=900)
    report = json.loads((out / "report.json").read_text())
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines()
              if line.startswith("step ")]
    return proc.returncode, report, losses


def probe(script: str, args: list[str]) -> dict[str, dict[int, float]]:
    proc = subprocess.run([sys.executable, str(SCRIPTS / "curves_probe.py"), script, *args],
                          capture_output=True, text=True, env=env(), timeout=900, check=True)
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: {int(s): v for s, v in d.items()} for k, d in raw.items()}


def probe_choice(rec: dict[str, dict[int, float]], kind: str, head: str) -> str | None:
    """The probe's own answer, by the rule's criterion: of the logit series that grew 10x to 100
    or more, the first to cross 100, the largest at that step."""
    series = {k: v for k, v in rec.items() if k.endswith("attn")} if kind == "attention" \
        else {head: rec.get(head, {})}
    best = None
    for name, by in series.items():
        pts = sorted(by.items())
        cross = next(((s, v) for s, v in pts if v >= 100), None)
        if cross is None or cross[1] < 10 * pts[0][1]:
            continue
        if best is None or (cross[0], -cross[1]) < (best[1], -best[2]):
            best = (name, cross[0], cross[1])
    return best[0] if best else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=list(ARCHS))
    ap.add_argument("--json")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--verify", type=int, default=4,
                    help="nanhunt's --verify for the failing cases (default: the CLI's, 4: "
                         "the experiments run); the fixes by hand and the healthy controls run "
                         "with it too")
    opts = ap.parse_args(argv)
    rows = []
    work = Path(tempfile.mkdtemp(prefix="curves-matrix-"))
    archs = [opts.only] if opts.only else list(ARCHS)
    for arch in archs:
        script = ARCHS[arch]
        for name, (args, rule, kind, signal, fix) in PATTERNS.items():
            args = [a.format(head=HEAD[arch]) for a in args]
            if "--steps" not in args:
                args = ["--steps", str(opts.steps), *args]
            t0 = time.time()
            code, rep, losses = diagnose(script, args, work / f"{arch}-{name}", opts.verify)
            d = rep["diagnosis"] or {}
            row = {"arch": arch, "case": name, "exit": code, "rule": d.get("rule"),
                   "kind": d.get("kind"), "module": d.get("module"),
                   "expected": [rule, kind], "ok": code == 1 and d.get("rule") in (
                       rule if isinstance(rule, tuple) else (rule,))
                   and d.get("kind") == kind if rule else None}
            if signal:
                want = probe_choice(probe(script, args), signal, HEAD[arch])
                row["probe"] = want
                row["ok"] = bool(row["ok"]) and want == d.get("module")
            fcode, _, flosses = diagnose(script, [*args, *fix], work / f"{arch}-{name}-fix",
                                         opts.verify)
            row["fix"] = " ".join(fix)
            row["fix_exit"] = fcode
            row["fix_trains"] = bool(flosses) and bool(losses) and flosses[-1] < losses[-1] \
                and fcode == 0
            row["losses"] = [losses[-1] if losses else None, flosses[-1] if flosses else None]
            row["seconds"] = round(time.time() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
        for name, args in CONTROLS.items():
            args = args[arch] if isinstance(args, dict) else args
            if "--steps" not in args:
                args = ["--steps", str(opts.steps), *args]
            code, rep, _ = diagnose(script, args, work / f"{arch}-{name}", opts.verify)
            errors = [w for w in [rep["diagnosis"], *rep["warnings"]]
                      if w and w["severity"] == "error"]
            row = {"arch": arch, "case": name, "exit": code, "ok": code == 0 and not errors,
                   "warnings": [(w["rule"], w["step"]) for w in rep["warnings"]]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    bad = [r for r in rows if r.get("ok") is False]
    print(f"{len(rows) - len(bad)} of {len(rows)} cases as expected", flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
