"""Data-parallel training over `mx.distributed` (`mlx.launch -n N`, ring over TCP / Thunderbolt, or MPI).

Every rank holds the whole draft and the whole frozen target and computes its share of each global
batch (a contiguous slice of the step's sequences). The step is the single-process step up to the
order of float sums: each rank's loss is its share of the *global* weighted mean (normalized by the
global sums of the position weights and of the blocks, all-summed before the backward pass), times
N, so averaging the rank gradients (`mlx.nn.average_gradients`: all_sum / N) gives the gradient of
the global mean. Weights and optimizer state start equal on every rank (rank 0's are broadcast), and
every rank applies the same update to the same averaged gradients, so they stay equal.

On one process (no `mlx.launch`) the world has size 1 and none of this does anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten


@dataclass(frozen=True)
class World:
    group: Optional[Any]  # mx.distributed.Group, None on a single process
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that logs, writes checkpoints and saves the draft."""
        return self.rank == 0

    def share(self, count: int) -> slice:
        """This rank's contiguous part of `count` global sequences (sizes differ by at most one)."""
        if count < self.size:
            raise ValueError(
                f"the global batch has {count} sequences for {self.size} ranks: pass --batch-size >= {self.size} "
                "(and enough data chunks), or launch fewer ranks"
            )
        base, extra = divmod(count, self.size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (1 if self.rank < extra else 0))

    def all_sum(self, x: mx.array) -> mx.array:
        if self.group is None:
            return x
        return mx.distributed.all_sum(x, group=self.group)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's `value` on every rank (others pass anything)."""
        if self.group is None:
            return value
        mine = mx.array(value if self.is_main else 0, dtype=mx.int64)
        return int(self.all_sum(mine).item())

    def broadcast_tree(self, tree: Any) -> Any:
        """Rank 0's arrays of `tree` on every rank; every rank passes a tree of the same names and shapes.

        Walked in sorted name order, so trees built in a different insertion order (a freshly
        initialized optimizer state against one read from a checkpoint) still line up."""
        if self.group is None:
            return tree
        flat = dict(tree_flatten(tree))
        out = []
        for name in sorted(flat):
            value = flat[name]
            if not isinstance(value, mx.array):
                out.append((name, value))
                continue
            mine = value if self.is_main else mx.zeros_like(value)
            out.append((name, self.all_sum(mine)))
        mx.eval([v for _, v in out if isinstance(v, mx.array)])
        return tree_unflatten(out)


def init_world() -> World:
    """The group `mlx.launch` set up (its environment variables), or a world of one process."""
    if not mx.distributed.is_available():
        return World(None)
    group = mx.distributed.init()
    if group.size() == 1:
        return World(None)
    return World(group, rank=group.rank(), size=group.size())
