"""A command started by `mlx.launch` over several ranks: the target split over them (models/distributed/split_target.py).

Rank 0 runs the command as on one machine and is the only one that writes; the other ranks load the
same files, take their slice and follow rank 0's target forwards until it is done (its exit releases
them, an error too)."""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from mlx_dspark.cli.errors import fail


PIPELINE_HELP = ("Under mlx.launch: split the target pipeline-parallel (a run of layers per rank, mlx-lm's `pipeline`) "
                 "instead of tensor-parallel (a slice of every layer, its `shard`; the default where the family has one).")


def launched_group() -> Optional[Any]:
    """The group of an `mlx.launch` run with more than one rank, else None (a plain run never touches
    the distributed backend)."""
    if "MLX_RANK" not in os.environ:
        return None
    import mlx.core as mx

    group = mx.distributed.init()
    return group if group.size() > 1 else None


def target_splitter(group: Optional[Any], *, pipeline: bool = False, serving: bool = False) -> Optional[Callable[[Any, Path], None]]:
    """`load(split=...)` for a run over `group` (None: a plain run): before the target's weights are read, the
    rank watch starts (a rank that dies or hangs from here on ends the job in one line), the ranks agree they
    load the same files, and the target is split over them (tensor parallel where mlx-lm's class can, else
    or with `pipeline` pipeline parallel), so each rank reads and holds its own slice only. `serving`: rank 0
    is the server, which keeps SIGTERM for its own shutdown (its clients answered, then the followers
    released) instead of ending in one error line."""
    if group is None:
        return None
    from mlx_dspark.cli.rank_watch import watch_ranks
    from mlx_dspark.loading.fingerprint import target_fingerprint
    from mlx_dspark.models.distributed.split_target import PIPELINE, SplitTargetError, agree, split_target

    def split(target: Any, path: Path) -> None:
        rank = group.rank()
        watch_ranks(rank, terminate=not (serving and rank == 0))
        try:
            agree(group, target_fingerprint(path), what="target (versions, config, weights)")
            object.__setattr__(target, "_split_mode", split_target(target, group, mode=PIPELINE if pipeline else None))
        except SplitTargetError as err:
            fail(f"rank {rank}: {err}")

    return split


def split_or_follow(pair: Any, group: Any) -> None:
    """After a load split over `group` (`target_splitter`): on rank 0 make the target lead and return,
    elsewhere follow rank 0's forwards and exit."""
    from mlx_dspark.cli.rank_watch import lost
    from mlx_dspark.models.distributed.split_target import follow, lead

    on_lost = functools.partial(lost, group.rank())
    mode = pair.target._split_mode
    if group.rank() != 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 writes the answer
        # rank 0 decides when the job ends (a terminal's Ctrl-C reaches every rank on its machine): it releases
        # the followers once it is done, between forwards
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        forwards = follow(pair.target, group, on_lost=on_lost)
        typer.echo(f"[mlx_dspark] rank {group.rank()}: followed {forwards} target forwards", err=True)
        raise typer.Exit(0)
    lead(pair.target, group, on_lost=on_lost)
    atexit.register(pair.target.release_followers)  # however rank 0 ends (an error line included)
    typer.echo(f"[mlx_dspark] target split over {group.size()} ranks ({mode} parallel); the draft runs on rank 0", err=True)
