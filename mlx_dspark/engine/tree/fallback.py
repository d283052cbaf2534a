"""Why a request asking for tree rounds (issue 37) runs chain rounds instead, and saying so once.

A tree round (tree_steps.py) verifies without logits processing (penalties, logit_bias, a constraint and
logprobs would need each branch's own history), without prompt lookup or the chain-round cuts
(verify_schedule, p_min, confidence_threshold, a sampled draft), with a DSpark block draft that grows
trees from its own distributions, on a target whose caches a tree verify can commit (models/target/tree_verify.py:
attention-only, full KV). Where one of these is missing, the request runs the ordinary chain rounds with
every feature intact (lossless either way) and says why in one line: an `EngineNote` (a UserWarning, as a
batched row's, batch.py), which Python shows once per message and the CLI prints as one line (cli/errors.py).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from mlx_dspark.engine.options import GenerationOptions


class EngineNote(UserWarning):
    """Something the engine did instead of what was asked, without changing the output."""


def option_reasons(options: GenerationOptions) -> list[str]:
    """The request's options a tree round does not run with (empty: none)."""
    sampling, speculation = options.sampling, options.speculation
    chain_only = {
        "logprobs": options.logprobs is not None, "a constraint": options.constraint is not None,
        "penalties": sampling.has_penalties, "logit_bias": bool(sampling.logit_bias),
        f"lookup {speculation.lookup!r}": speculation.lookup != "off",
        f"verify_schedule {speculation.verify_schedule!r}": speculation.verify_schedule != "fixed",
        "p_min": speculation.p_min > 0, "confidence_threshold": speculation.confidence_threshold > 0,
        f"draft_sampling {speculation.draft_sampling!r}": speculation.draft_sampling != "greedy",
    }  # fmt: skip
    return [name for name, on in chain_only.items() if on]


def draft_reason(model: Any, proposer: Any) -> str | None:
    """Why the pair's draft (or the given proposer) grows no trees, or None."""
    if proposer is not None:
        return None if proposer.grows_trees else f"the proposer {type(proposer).__name__} grows no trees"
    draft = getattr(model, "draft", None)
    if draft is None:
        return "no DSpark block draft (trees grow from a block draft's distributions, not chained heads or lookup)"
    if not draft.grows_trees:
        return f"a {type(draft).__name__} draft (it drafts through its own heads, not DSpark's distributions)"
    return None


def say_chain_rounds(tree_nodes: int | str, reasons: Sequence[str]) -> None:
    """The one line: what made a tree request run chain rounds."""
    warnings.warn(f"tree_nodes {tree_nodes!r}: chain rounds instead of tree rounds ({'; '.join(reasons)})",
                  EngineNote, stacklevel=3)
