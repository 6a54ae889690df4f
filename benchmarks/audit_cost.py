"""What `nanhunt audit` costs: wall time of a plain run against an audited one, and the
audit's own time per audited step against a plain step (from report.json).

    python benchmarks/audit_cost.py [--steps 20] [--audit-steps 3] [script ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["examples/audit/shift_mlp.py", "examples/audit/shift_cnn.py",
           "examples/audit/rope_transformer.py", "examples/healthy_gpt.py"]


def _wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=False, capture_output=True)
    return time.perf_counter() - t0


def _ms(x: object) -> str:
    return f"{1000 * x:.1f}" if isinstance(x, float) else "—"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20, help="training steps of each script")
    p.add_argument("--audit-steps", type=int, default=3)
    p.add_argument("scripts", nargs="*", default=DEFAULT)
    args = p.parse_args()
    print("| script | plain run (s) | audited run (s) | plain step (ms) | audit per step "
          "and target (ms) | ratio |")
    print("|---|---|---|---|---|---|")
    for script in args.scripts:
        out = Path(tempfile.mkdtemp())
        plain = _wall([sys.executable, script, "--steps", str(args.steps)])
        audited = _wall([sys.executable, "-m", "nanhunt", "audit", "--quiet", "--warmup", "3",
                         "--steps", str(args.audit_steps), "--out", str(out), script,
                         "--steps", str(args.steps)])
        pr = json.loads((out / "report.json").read_text())["precision"] or {}
        step, audit = pr.get("seconds_plain_step"), pr.get("seconds_audit")
        ratio = f"{audit / step:.0f}x" if step and audit else "—"
        print(f"| {script} | {plain:.2f} | {audited:.2f} | {_ms(step)} | {_ms(audit)} | "
              f"{ratio} |")


if __name__ == "__main__":
    main()
