"""A command started by `mlx.launch` over several ranks: the target split over them (models/split_target.py).

Rank 0 runs the command as on one machine and is the only one that writes; the other ranks load the
same files, take their slice and follow rank 0's target forwards until it is done (its exit releases
them, an error too)."""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
from typing import Any, Optional

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


def split_or_follow(pair: Any, group: Any, *, pipeline: bool = False, serving: bool = False) -> None:
    """Split the loaded target over `group` (tensor parallel where mlx-lm's class can, else or with
    `pipeline` pipeline parallel); on rank 0 make it lead and return, elsewhere follow and exit. `serving`:
    rank 0 is the server, which keeps SIGTERM for its own shutdown (its clients answered, then the followers
    released) instead of ending in one error line."""
    from mlx_dspark.cli.rank_watch import lost, watch_ranks
    from mlx_dspark.loading.fingerprint import target_fingerprint
    from mlx_dspark.models.split_target import PIPELINE, SplitTargetError, agree, follow, lead, split_target

    rank = group.rank()
    watch_ranks(rank, terminate=not (serving and rank == 0))  # a rank that dies or hangs from here on ends the job in one line
    on_lost = functools.partial(lost, rank)
    try:
        agree(group, target_fingerprint(pair.target_path), what="target (versions, config, weights)")
        mode = split_target(pair.target, group, mode=PIPELINE if pipeline else None)
    except SplitTargetError as err:
        fail(f"rank {group.rank()}: {err}")
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
