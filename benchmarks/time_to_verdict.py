"""Time to a verdict by experiment against the plain script's time to its failure.

For each failing script: the wall time of ``python script.py`` from its start to the first line
it prints with a non-finite loss or a skipped step (its time to the failure; to its end when it
prints none), and the wall time of ``nanhunt diagnose script.py`` from start to exit: the run to
the failure, the analysis, the control, the experiment ladder and the fix search (the verdict
and the verified fix, if any, are read from its report). The goal (issue 20) is nanhunt's time
at most 3x the plain script's time to its failure on 2 CPUs.

    OMP_NUM_THREADS=1 python benchmarks/time_to_verdict.py [--jobs N] [--only NAME ...]
        [--json OUT.json]

Scripts: the failing examples and benchmarks/verdict/*.py (five failures written for this
benchmark). Each is run once, one at a time; the machine's load is part of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["ffn_overflow.py", "log_zero_loss.py", "nan_batch.py", "high_lr.py",
            "scale_collapse.py", "sqrt_backward.py", "grad_underflow.py"]
FAILED = re.compile(r"\b(nan|inf|skipped)\b", re.I)


def plain_time_to_failure(script: Path, cwd: Path) -> tuple[float, float, bool]:
    """(seconds to the first failing line or the end, seconds to the end, a failing line seen)."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, bufsize=1,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    at = None
    for line in proc.stdout:  # type: ignore[union-attr]
        if at is None and FAILED.search(line):
            at = time.monotonic() - start
    proc.wait()
    end = time.monotonic() - start
    return (at if at is not None else end), end, at is not None


def nanhunt_verdict(script: Path, cwd: Path, jobs: int | None) -> dict:
    out = cwd / "report"
    cmd = [sys.executable, "-m", "nanhunt", "diagnose", "--quiet", "--out", str(out)]
    if jobs:
        cmd += ["--jobs", str(jobs)]
    start = time.monotonic()
    proc = subprocess.run([*cmd, str(script)], cwd=cwd, capture_output=True, text=True)
    seconds = time.monotonic() - start
    try:
        report = json.loads((out / "report.json").read_text())
    except (OSError, ValueError):
        return {"seconds": seconds, "exit": proc.returncode, "verdict": "no report"}
    ex = report.get("experiments") or {}
    fix = next((r for r in report["recommendations"] if r["verified"]), None)
    return {"seconds": round(seconds, 2), "exit": proc.returncode,
            "verdict": ex.get("verdict") or "", "source": ex.get("source") or "",
            "reruns": len(ex.get("runs") or []), "rerun_seconds": ex.get("seconds"),
            "verified_fix": fix["fix"] if fix else None,
            "kind": (report.get("diagnosis") or {}).get("kind")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=None, help="nanhunt diagnose --jobs")
    p.add_argument("--only", nargs="*", default=None, help="script names to run")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    scripts = [ROOT / "examples" / s for s in EXAMPLES] + sorted(
        (ROOT / "benchmarks" / "verdict").glob("*.py"))
    if args.only:
        scripts = [s for s in scripts if s.name in args.only or s.stem in args.only]
    rows = []
    print("| script | plain: to failure | nanhunt: to verdict | ratio | verdict | verified fix |")
    print("|---|---:|---:|---:|---|---|")
    for script in scripts:
        with tempfile.TemporaryDirectory() as tmp:
            to_fail, total, failed = plain_time_to_failure(script, Path(tmp))
        with tempfile.TemporaryDirectory() as tmp:
            nh = nanhunt_verdict(script, Path(tmp), args.jobs)
        ratio = nh["seconds"] / to_fail if to_fail else float("nan")
        row = {"script": script.name, "plain_to_failure": round(to_fail, 2),
               "plain_total": round(total, 2), "plain_failed": failed, **nh,
               "ratio": round(ratio, 2)}
        rows.append(row)
        fix = " ".join(nh.get("verified_fix") or []) or "none"
        print(f"| {script.name} | {to_fail:.1f} s | {nh['seconds']:.1f} s | {ratio:.1f}x | "
              f"{nh.get('verdict') or nh.get('kind') or '-'} | {fix} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version()},
            "jobs": args.jobs, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
