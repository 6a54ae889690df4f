"""Time to diagnosis: a failure planted at step 500 of the transformer of overhead.py, found by
the sentinel, by full tracing from the start, and the same steps without nanhunt.

Run from the repository root::

    python benchmarks/time_to_diagnosis.py                 # tiny transformer, step 500
    python benchmarks/time_to_diagnosis.py --size full --at 500 --json t.json

At step ``--at`` the embedding rows of that batch's tokens are set to inf (a corruption from
outside the optimizer, like a bad checkpoint merge); the forward of that step is the first to
go non-finite. ``plain`` runs the same steps and stops there (the floor). ``full`` is a
:class:`nanhunt.Hunt` from step 0 that stops after the failing step, then analyses and writes
the reports. ``sentinel`` is :func:`nanhunt.sentinel` with ``stop=True``: it replays the failing
step with full tracing, analyses and writes the reports before stopping. Each variant's time is
from its first step until its reports are on disk (wall clock and this process's CPU time).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import overhead

import nanhunt
from nanhunt.capture import StopRun
from nanhunt.pipeline import analyse_and_report
from nanhunt.trace import RunInfo

VARIANTS = ("plain", "full", "sentinel")


def run(variant: str, size: str, at: int, out: Path) -> dict[str, Any]:
    w = overhead.Workload("transformer", "fp32", overhead.SHAPES[size], torch.device("cpu"))
    t0, c0 = time.perf_counter(), time.process_time()
    session: Any = None
    if variant == "full":
        session = nanhunt.Hunt(w.model, w.optimizer, w.scaler, stop_on_problem=True).start()
    elif variant == "sentinel":
        session = nanhunt.sentinel(w.model, w.optimizer, w.scaler, out=out, stop=True).start()
    steps = 0
    try:
        for i in range(at + 1):
            if i == at:
                with torch.no_grad():
                    w.model[0].weight[w.x.flatten().unique()] = float("inf")
            steps = i + 1
            w.step()
    except StopRun:
        pass
    finally:
        if session is not None:
            session.stop()
    if variant == "full":
        analyse_and_report(session, RunInfo(script="time_to_diagnosis"), out, quiet=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    row: dict[str, Any] = {"variant": variant, "steps": steps, "wall_s": wall, "cpu_s": cpu}
    if session is not None:
        f = session.first_failure
        row["first_failure"] = f.where() if f is not None else None
        row["report"] = (out / "report.json").exists()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=tuple(overhead.SHAPES), default="tiny")
    p.add_argument("--at", type=int, default=500, help="the failing step (default 500)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for v in args.variants.split(","):
        with tempfile.TemporaryDirectory() as d:
            row = run(v, args.size, args.at, Path(d))
        rows.append(row)
        print(f"{v:9s} steps {row['steps']:5d}  wall {row['wall_s']:8.2f} s  cpu "
              f"{row['cpu_s']:8.2f} s  {row.get('first_failure') or ''}", flush=True)
    plain = next((r for r in rows if r["variant"] == "plain"), None)
    if plain is not None:
        for r in rows:
            r["cpu_ratio"] = r["cpu_s"] / plain["cpu_s"]
            print(f"{r['variant']:9s} {r['cpu_ratio']:.2f}x the plain run's CPU time")
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "at": args.at, "rows": rows,
                                         "torch": torch.__version__}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
