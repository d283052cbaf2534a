"""The one way to reach a target's output head (`target_head`), for every caller that needs its rows
(the pair checks, a draft's restricted vocabulary, export).

A target's head is one of: its own module (`lm_head`, or whatever an mlx-lm target's `output_head`
finds, a multimodal wrapper's included), or the input embedding when tied. Whether it is tied is
read from the built model, not only from its config: mlx-lm's gemma3_text (and others) decide it in
`sanitize`, popping `lm_head` when the checkpoint has none, while their args never name it."""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn


def target_head(target: Any) -> nn.Module:
    """The module whose rows (`.weight`, possibly quantized) are the target's LM head: the untied head
    module when the model has one, else the input embedding (tied; apply it with `as_linear`)."""
    if hasattr(type(target), "output_head"):  # an mlx-lm target: it finds its head under any wrapper
        head = target.output_head
        return target.embedding if head is None else head
    if getattr(target.args, "tie_word_embeddings", False) or getattr(target, "lm_head", None) is None:
        return target.embedding
    return target.lm_head


def head_is_tied(target: Any) -> bool:
    """Whether the target's head rows are its input embedding's."""
    return target_head(target) is target.embedding


def head_as_loaded(target: Any, stored: mx.array) -> Optional[mx.array]:
    """A checkpoint's copy of the target's head (`lm_head.weight`) as the target reads its own: through the
    family's `sanitize`, where mlx-lm turns the stored rows into those the model computes with (baichuan_m1's
    NormHead normalizes each row there). None when the family's sanitize does not hand the tensor back."""
    sanitize = getattr(target, "sanitize", None)
    if sanitize is None:
        return None
    try:
        read = sanitize({"lm_head.weight": stored})
    except (KeyError, ValueError, TypeError, IndexError, AttributeError):  # a sanitize that needs the whole checkpoint
        return None
    heads = [v for k, v in read.items() if k.endswith("lm_head.weight")]
    return heads[0] if len(heads) == 1 and heads[0].shape == stored.shape else None
