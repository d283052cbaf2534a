"""Proposers: the declared interface every draft head implements (`base`), one module per head named as in
`models/heads/` (found by name through `models.heads.HEADS`), the chained drafters' shared loop and state
(`chain`, `chain_context`), prompt lookup (`lookup`).

A head's proposer module declares `COST_KIND` (base.BLOCK or base.CHAIN: how its cost curve is measured),
`default_block(module)` (the most drafts one proposal holds by default) and `make_proposer(module, target, *,
prompt, greedy, temperature, block_size, prompt_cache)`. The functions below are the only way the engine
reaches a head: by its name, over a loaded pair's `heads` mapping.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Sequence

from mlx_dspark.models.heads import HEADS, head_module_name


def proposer_module(head: str) -> ModuleType:
    """The proposer module of `head` (engine/proposers/<module>.py)."""
    return importlib.import_module(f"mlx_dspark.engine.proposers.{head_module_name(head)}")


def loaded_heads(model: Any) -> list[str]:
    """The heads a loaded pair carries, in registry order."""
    return [name for name in HEADS if model.heads.get(name) is not None]


def default_head(model: Any) -> str:
    """The head a pair's one curve is for: its first loaded head ("draft" when it has none)."""
    return next(iter(loaded_heads(model)), "draft")


def cost_kind(head: str) -> str:
    return proposer_module(head).COST_KIND


def head_block(model: Any, head: str) -> int:
    """The most drafts one proposal of `head` holds by default (a block draft's block; a chain's length)."""
    return int(proposer_module(head).default_block(model.heads[head]))


def make_head_proposer(model: Any, head: str, *, prompt: Sequence[int], greedy: bool, temperature: float,
                       block_size: int | None = None, prompt_cache: Any = None) -> Any:  # fmt: skip
    """`head`'s proposer over the loaded pair; over `prompt_cache`'s state for it when given (a later turn
    resumes it). `block_size`: a chain's steps per proposal (default its `default_block`)."""
    module = model.heads[head]
    return proposer_module(head).make_proposer(
        module, model.target, prompt=prompt, greedy=greedy, temperature=temperature,
        block_size=block_size, prompt_cache=prompt_cache,
    )  # fmt: skip
