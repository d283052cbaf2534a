"""An EAGLE-3 draft in vLLM speculators' layout (`load(target, draft=<dir>)` with `speculators_model_type:
eagle3` in its config.json): checked against its target, built into models/eagle3.Eagle3Draft.

The draft's `embed_tokens.weight`, when the file holds one, is a frozen copy of the target's embedding
(speculators' `embed_requires_grad` false, the default): it is compared with the target's (pair.py, as
DSpark drafts' copies are) and dropped, and the draft embeds with the target's table. A draft that trained
its own (`embed_requires_grad: true`) keeps it, and so does a draft narrower or wider than its target
(`transformer_layer_config.hidden_size` != the target's): its table cannot be the target's (vLLM shares the
target's only when the shapes match).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.loading.checkpoint import Checkpoint
from mlx_dspark.loading.heads import refuse_block_options
from mlx_dspark.loading.pair import check_shared_tensors
from mlx_dspark.loading.weights import fill_model
from mlx_dspark.models.heads.d2t import CHECKPOINT_NAME
from mlx_dspark.models.heads.eagle3.model import Eagle3Draft, canonical_name
from mlx_dspark.models.heads.eagle3.args import Eagle3Args, default_aux_ids, is_eagle3_config

EMBEDDING = "embed_tokens.weight"


def check_pair(target_args: Any, args: Eagle3Args, *, target_source: str, draft_source: str) -> None:
    """ValueError naming the draft's field and the target's value for a pair that cannot work."""

    def mismatch(field: str, ours: Any, theirs: Any, why: str = "they must be equal") -> ValueError:
        return ValueError(f"{draft_source}: {field} is {ours!r} but the target ({target_source}) has {theirs!r}: {why}")

    if args.vocab_size != target_args.vocab_size:
        raise mismatch("transformer_layer_config.vocab_size", args.vocab_size, target_args.vocab_size)
    if args.target_hidden_size != target_args.hidden_size:
        raise mismatch("target_hidden_size", args.target_hidden_size, target_args.hidden_size)
    if not args.own_embedding and args.hidden_size != target_args.hidden_size:
        raise mismatch("transformer_layer_config.hidden_size", args.hidden_size, target_args.hidden_size,
                       "the draft stores no embed_tokens.weight of its own width, so it would embed with the target's table")  # fmt: skip
    n = target_args.num_hidden_layers
    given = args.aux_layer_ids is not None
    aux = list(args.aux_layer_ids) if given else default_aux_ids(n)
    field = "eagle_aux_hidden_state_layer_ids" if given else f"eagle_aux_hidden_state_layer_ids (absent: vLLM's default {aux})"
    if len(set(aux)) != len(aux) or not all(0 <= i <= n - 1 for i in aux):
        raise ValueError(
            f"{draft_source}: {field} must be distinct hidden-state indices in [0, {n - 1}] for a target of "
            f"{n} layers ({target_source}); give eagle_aux_hidden_state_layer_ids"
        )


def build_eagle3(checkpoint: Checkpoint, *, target: Optional[nn.Module], target_source: str = "target",
                 dtype: Optional[mx.Dtype] = None) -> Eagle3Draft:
    """The draft (lazy weights), its pair with `target` checked and an embedding copy compared (target
    None: the draft alone, as the exporter reads it without a target)."""
    config, config_source, source = checkpoint.config, checkpoint.config_source, str(checkpoint.path)
    args = Eagle3Args.from_dict(config, source=config_source)
    if target is not None and not args.own_embedding and args.hidden_size != target.args.hidden_size and EMBEDDING in checkpoint.weights:
        args = replace(args, own_embedding=True)  # a table of the draft's own width cannot be the target's (vLLM keeps it)
    if target is not None:
        check_pair(target.args, args, target_source=target_source, draft_source=config_source)
    weights = dict(checkpoint.weights)
    if args.reduced_vocab and CHECKPOINT_NAME not in weights:
        raise ValueError(
            f"{source}: draft_vocab_size {args.draft_vocab_size} is below the target's vocabulary ({args.vocab_size}) "
            f"but the weights hold no '{CHECKPOINT_NAME}' tensor (draft row -> target id offsets)"
        )
    copy = None if args.own_embedding else weights.pop(EMBEDDING, None)
    origin = {canonical_name(k): v for k, v in checkpoint.origin.items()}
    model = fill_model(
        Eagle3Draft(args), config, weights, origin, source=source, what="EAGLE-3 draft",
        dtype=checkpoint.default_dtype if dtype is None else dtype, config_name=Path(config_source).name,
    )  # fmt: skip
    if copy is not None and target is not None:
        own = check_shared_tensors({EMBEDDING: copy}, target, draft_source=source, storage=checkpoint.storage)
        if own:
            raise ValueError(
                f"{source}: tensor '{EMBEDDING}' differs from the target's embedding in rows {sorted(own)[:8]}; an "
                "EAGLE-3 draft with its own rows runs only with embed_requires_grad: true (its whole table its own)"
            )
    return model


def quantize_eagle3(model: nn.Module, *, bits: int, group_size: int) -> None:
    """The draft's linear layers at the given width (its norms, embedding and d2t stay as they are)."""
    nn.quantize(model, group_size, bits, class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0)


# -- the head's loader declarations (loading/heads/__init__.py) ---------------------------------------------
DESCRIPTION = "an EAGLE-3 draft"
HELP = "an EAGLE-3 draft (vLLM speculators layout)"  # --draft's help


def detect(config: dict) -> bool:
    return is_eagle3_config(config)


def build(checkpoint: Checkpoint, *, target: nn.Module, target_source: str, dtype: Optional[mx.Dtype],
          options: dict[str, Any]) -> Eagle3Draft:  # fmt: skip
    refuse_block_options(options, source=checkpoint.config_source,
                         this="an EAGLE-3 draft (its taps are eagle_aux_hidden_state_layer_ids, its vocabulary its d2t)")
    return build_eagle3(checkpoint, target=target, target_source=target_source, dtype=dtype)


quantize = quantize_eagle3
