"""Printing a replay: the op-level trace, the first non-finite op marked (``nanhunt replay``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from nanhunt.capture.state import Snapshot
from nanhunt.formats import get_format
from nanhunt.replay.ops import ReplayResult

__all__ = ["print_replay"]

def print_replay(snap: Snapshot, result: ReplayResult, console: Any) -> None:
    """The op-level trace of a replay, the first non-finite op marked."""
    from rich.table import Table

    console.print(f"[bold]replay of {snap.name}[/] ({type(snap.module).__name__}, "
                  f"step {snap.step}, failure in {snap.phase})")
    table = Table(show_edge=False, pad_edge=False)
    for col in ("#", "op", "phase", "dtype", "amax", "non-finite", "source"):
        table.add_column(col, overflow="fold")
    for op in result.ops:
        mark = "[bold red]▶[/] " if op.first_nonfinite else ""
        source = op.source or ""
        if source:
            where, _, text = source.partition("  ")
            path, _, line = where.rpartition(":")
            source = f"{Path(path).name}:{line}" + (f"  {text}" if text else "")
        table.add_row(str(op.index), mark + op.op, op.phase, op.dtype,
                      f"{op.amax:.3g}" if math.isfinite(op.amax) else str(op.amax),
                      str(op.nonfinite), source)
    console.print(table)
    if result.dropped_ops:
        console.print(f"… {result.dropped_ops} more ops not shown")
    if result.error:
        console.print(f"[red]the replay raised {result.error}[/]")
    if result.first is not None:
        console.print(f"first non-finite value: [bold]{result.first.op}[/] ({result.first.phase})"
                      + (f" at {result.first.source}" if result.first.source else ""))
    else:
        console.print("every op produced finite values in this replay")
    for name, fmt in (("float16", get_format("float16")),):
        if result.output_amax > fmt.max:
            console.print(f"the output's amax {result.output_amax:.3g} exceeds {name}'s max "
                          f"{fmt.max:g}: it overflows when cast back to {name}")
