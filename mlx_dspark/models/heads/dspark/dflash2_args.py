"""The DFlash 2 fields of a draft config (models/heads/dspark/dflash2.py runs the draft): read apart from the model
so that `DraftArgs` can parse them without importing it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

ARCHITECTURE = "DFlash2DraftModel"
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class DFlash2Fields:
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None


def dflash2_fields(config: dict, *, hidden_size: int, vocab_size: int, source: str) -> Optional[DFlash2Fields]:
    """The DFlash 2 fields of a draft config (top level or `dflash_config`); None for any other draft."""
    nested = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    arch = (config.get("architectures") or [""])[0]
    names = (*FIELDS, "output_multiplier", "final_logit_softcapping")
    for k in names:
        if nested.get(k) is not None and config.get(k) is not None and nested[k] != config[k]:
            raise ValueError(f"{source}: {k} is {config[k]!r} but dflash_config.{k} is {nested[k]!r}; they must agree")
    given = {k: nested.get(k, config.get(k)) for k in names}
    if arch != ARCHITECTURE and all(given[k] is None for k in FIELDS):
        return None
    missing = [k for k in FIELDS if given[k] is None]
    if missing:
        raise ValueError(f"{source}: a DFlash2 draft needs dflash_config field(s) {missing}")
    for k in FIELDS:
        v = given[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{source}: field 'dflash_config.{k}' must be an integer >= 1, got {v!r}")
    if hidden_size % given["conv_group_size"]:
        raise ValueError(f"{source}: dflash_config.conv_group_size {given['conv_group_size']} must divide hidden_size {hidden_size}")
    if given["selector_top_k"] > vocab_size:
        raise ValueError(f"{source}: dflash_config.selector_top_k {given['selector_top_k']} exceeds the vocabulary ({vocab_size})")
    scale, cap = given["output_multiplier"], given["final_logit_softcapping"]
    # a zero multiplier would tie every logit (the candidates then depend on how ties break); 0 turns the cap off
    for name, v, low in (("output_multiplier", scale, "> 0"), ("final_logit_softcapping", cap, ">= 0")):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (v == 0 and low == "> 0"):
            raise ValueError(f"{source}: field 'dflash_config.{name}' must be a finite number {low}, got {v!r}")
    return DFlash2Fields(
        **{k: given[k] for k in FIELDS},
        output_multiplier=1.0 if scale is None else float(scale),
        final_logit_softcapping=float(cap) if cap else None,
    )


def check_dflash2_heads(
    *, sample_from_anchor: bool, draft_vocab_size: Optional[int], markov_rank: int, confidence: bool, source: str
) -> None:
    """Refuse what a DFlash 2 draft's selector would silently ignore: it drafts from block rows 1.. (row 0
    is the anchor: `sample_from_anchor` must be false, speculators #1006), over the target's whole LM
    head (no `draft_vocab_size` / `d2t` rows), with no Markov or confidence head of DSpark's."""
    if sample_from_anchor:
        raise ValueError(
            f"{source}: field 'sample_from_anchor' is true but a DFlash2 draft drafts from block row 1 (row 0 is the anchor); "
            "leave it out or set it false"
        )
    if draft_vocab_size is not None:
        raise ValueError(
            f"{source}: field 'draft_vocab_size' is {draft_vocab_size} but a DFlash2 draft's selector reads the target's whole "
            "LM head; a reduced (d2t) vocabulary is not supported for DFlash2 drafts"
        )
    if markov_rank or confidence:
        what = "markov_rank > 0" if markov_rank else "enable_confidence_head true"
        raise ValueError(
            f"{source}: {what} on a DFlash2 draft: its candidate selector drafts, a DSpark Markov / confidence head "
            "would be ignored; not supported"
        )
