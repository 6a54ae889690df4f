"""Statistics of sharded tensors (FSDP2's DTensor parameters), reduced across ranks.

Each rank summarises its own shard (``stats.local``: no DTensor op, no collective per tensor).
Once per step, after the step's one transfer to the host, :class:`ShardReducer` gathers every
rank's shard rows in one ``all_gather`` (after a fixed-size header saying which tensors and how
many rows: ranks that disagree turn the reduction off instead of a gather of unequal sizes,
which gloo answers by aborting the process) over a gloo group of nanhunt's own (made once, on
the first step that has sharded rows; every rank reaches that step's transfer at the same point
of the loop, the optimizer's step), and the recorder merges them into the whole tensor's
statistics: counts and histograms add up, ``amax`` is the largest, ``amin`` the smallest.

The whole-tensor rows feed the module table and the timeline's gradient norm (the sums of
squares of the shards add up). The judge keeps reading this rank's own rows: which rank's shard
went non-finite first is what the origin rule needs.

A gather that fails (a peer that left, a timeout of ``NANHUNT_RANK_TIMEOUT`` seconds, shards
that disagree on which tensors they hold) turns the reduction off for the rest of the run, and
:attr:`ShardReducer.failed` says why; the statistics are then this rank's shards, as the report
notes.
"""

from __future__ import annotations

import datetime
import os
import zlib
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["ShardReducer", "is_sharded"]


def is_sharded(t: object) -> bool:
    """A DTensor split across the ranks (FSDP2, tensor parallel's Shard placements): this rank
    holds one shard of it. A DTensor replicated on every rank (tensor parallel's Replicate: a
    row-parallel layer's bias) holds the whole tensor on each: not sharded (adding the ranks'
    statistics would count it once per rank)."""
    if type(t).__name__ != "DTensor":
        return False
    placements = getattr(t, "placements", None)
    if not placements:
        return True
    return any(type(pl).__name__ in ("Shard", "_StridedShard") for pl in placements)


def _names_key(names: Sequence[str]) -> float:
    """The tensors' names, as a number every rank must agree on (exact in a float64)."""
    return float(zlib.crc32("\0".join(names).encode()))


class ShardReducer:
    """Two ``all_gather`` per step (a header, then the rows computed on local shards)."""

    def __init__(self) -> None:
        self.group = None
        self.failed: str | None = None
        self.gathers = 0  # collectives run (one per step with sharded rows)

    def world(self) -> int:
        try:
            import torch.distributed as dist
        except Exception:  # a torch without distributed
            return 1
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size()

    def gather(self, names: Sequence[str], block: np.ndarray) -> list[np.ndarray] | None:
        """Every rank's ``block`` (rows for the tensors ``names``, in that order), this rank's
        at its rank's index; None when there is no peer or the gather failed."""
        if self.failed is not None or self.world() < 2:
            return None
        import torch.distributed as dist

        try:
            if self.group is None:
                timeout = float(os.environ.get("NANHUNT_RANK_TIMEOUT", "60"))
                self.group = dist.new_group(backend="gloo",
                                            timeout=datetime.timedelta(seconds=timeout))
            # the header first, of a fixed size: blocks of different sizes in one gather
            # would abort gloo (and the user's job) instead of raising
            head = torch.tensor([_names_key(names), float(block.shape[0]),
                                 float(block.size)], dtype=torch.float64)
            heads = [torch.empty_like(head) for _ in range(dist.get_world_size())]
            dist.all_gather(heads, head, group=self.group)
            if any(not torch.equal(h, head) for h in heads):
                self.failed = "the ranks' sharded tensors differ (not the same parameters)"
                return None
            mine = torch.from_numpy(np.ascontiguousarray(block.reshape(-1)))
            outs = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(outs, mine, group=self.group)
            self.gathers += 1
        except Exception as exc:  # a peer gone, a timeout: the shards stay this rank's
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            return None
        return [out.numpy().reshape(block.shape) for out in outs]
