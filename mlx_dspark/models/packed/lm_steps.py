"""One-token steps of an mlx-lm model for several sequences at once: a draft model's chain steps in a batch.

A batch's draft-model rows (engine/proposers/draft_lm.py) each hold the draft's own caches, at their own
length. A chain step feeds every drafting row one token: mlx-lm's own `__call__` over inputs (b, 1) with,
as its cache list, the packed target forward's views (models/packed/mlx_lm.py `packed_views`): embedding,
projections, MLPs and head see the b rows at once, RoPE rotates each row at its own position, and only
the attention call (and a hybrid's recurrent mixers) runs per row over that row's own caches, the call
of its own step. So a packed step is each row's own step on a BLAS whose rows are independent, which
`steps_packing_problem` checks once per model (in the split modes a target's probe tries), never assumed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from mlx_dspark.models.packed.mlx_lm import choose_split_mode, packed_views


def packed_steps(model: Any, step: Callable[[list], mx.array], caches: Sequence[list], *, name: str) -> mx.array:
    """`step(cache_list)` (a step of mlx-lm's `model` over inputs (b, 1)) for b sequences, sequence i over
    its own cache list `caches[i]` -> the step's output (b, 1, ...). `name` says which model in an error."""
    with packed_views(model, caches, [1] * len(caches), name=name) as views:
        return step(views)


def steps_packing_problem(model: Any, step: Callable[[mx.array, list], mx.array], *, make_cache: Callable[[], list],
                          vocab: int, name: str, tolerance: float = 1e-3) -> Optional[str]:  # fmt: skip
    """Why one-token steps of `model` cannot run packed, or None (kept on the model). `step(ids (b, L),
    cache_list)` -> logits (b, L, V); `name` says which model."""
    known = getattr(model, "_dspark_steps_problem", False)
    if known is not False:
        return known
    problem = choose_split_mode(model, lambda: _probe(model, step, make_cache, vocab, name, tolerance), make_cache)
    if problem is not None:
        problem = f"{name} {problem}"
    object.__setattr__(model, "_dspark_steps_problem", problem)
    return problem


def _probe(model: Any, step: Callable, make_cache: Callable[[], list], vocab: int, name: str, tolerance: float) -> Optional[str]:
    """Three sequences whose caches read 2, 4 and 3 tokens take two more steps packed and each alone; what
    went wrong when they fail or differ (relative to the logits' scale), else None."""
    reads = (2, 4, 3)

    def filled() -> list[list]:
        sets = []
        for i, n in enumerate(reads):
            caches = make_cache()
            mx.eval(step(mx.array([[(5 + 13 * i + 7 * j) % vocab for j in range(n)]], dtype=mx.int32), caches))
            sets.append(caches)
        return sets

    ids = [mx.array([[(11 + 17 * i + 3 * k) % vocab] for i in range(len(reads))], dtype=mx.int32) for k in range(2)]  # (3, 1) each
    try:
        alone = mx.concatenate([
            mx.concatenate([step(ids[k][i : i + 1], caches) for k in range(2)], axis=1) for i, caches in enumerate(filled())
        ], axis=0)  # fmt: skip
        sets = filled()
        packed = mx.concatenate([packed_steps(model, lambda views, k=k: step(ids[k], views), sets, name=name) for k in range(2)], axis=1)
        worst = mx.max(mx.abs(packed - alone)).item() / max(mx.max(mx.abs(alone)).item(), 1e-6)
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError, AssertionError) as e:
        return f"fails in a packed step ({type(e).__name__}: {e})"
    if not worst <= tolerance:
        return f"differs in a packed step from its rows' own steps (relative {worst:.2g})"
    return None
