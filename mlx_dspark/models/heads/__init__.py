"""Draft heads, one folder each: `models/heads/<module>/` (config and model), its proposer beside it in
`engine/proposers/<module>.py` and its loader in `loading/heads/<module>.py`.

`HEADS` is the one list of them: the name a head goes by (in `LoadedModel.heads`, `--draft mtp`, cost-cache
keys and a round's statistics) -> the module name it has in each room. Every room finds a head's module by
that name (as mlx-lm finds `mlx_lm.models.<model_type>`); nothing else lists heads. The order is the order in
which a pair's heads are named and the first loaded one is the pair's default.
"""

from __future__ import annotations

HEADS = {
    "draft": "dspark",  # a block draft: DSpark, DFlash, DFlash 2
    "eagle3": "eagle3",  # an EAGLE-3 draft (speculators layout)
    "assistant": "gemma4_assistant",  # a Gemma 4 assistant drafter
    "lm": "draft_lm",  # a small causal LM of the target's vocabulary (mlx-lm's --draft-model)
    "mtp": "mtp",  # the target's own multi-token-prediction layers
    "self": "self_draft",  # the target's own first N layers, final norm and head (self-speculation)
}


def head_module_name(head: str) -> str:
    """The module name of `head` in every room; a clear error for a name no head goes by."""
    if head not in HEADS:
        raise ValueError(f"unknown draft head {head!r}; the heads are {list(HEADS)}")
    return HEADS[head]
