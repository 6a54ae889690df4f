"""Distributed training (DDP under torchrun): rank facts and the merged report."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .trace import Trace

__all__ = ["RankContext", "launch"]


@dataclass
class RankContext:
    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls) -> RankContext:
        return cls(rank=int(os.environ.get("RANK", "0")),
                   world_size=int(os.environ.get("WORLD_SIZE", "1")))

    def merge(self, trace: Trace) -> Trace:
        return trace


def launch(nproc: int, argv: list[str]) -> int:
    from .errors import NanhuntError

    raise NanhuntError("--nproc-per-node is not available yet")


def _unused(_: Any) -> None:
    pass
