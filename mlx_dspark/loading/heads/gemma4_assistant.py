"""A Gemma 4 assistant drafter (`load(target, draft=<dir>)` with `architectures: ["Gemma4AssistantForCausalLM"]`
in its config.json): checked against its Gemma 4 target, built into models/gemma4_assistant.Gemma4AssistantDraft.

The assistant reads the target's hidden state, embedding and K/V, so the pair must agree on the target's
hidden size (`backbone_hidden_size`), vocabulary, head widths, sliding window and the layer types it reads;
a mismatch is one line naming the assistant's file and field and the target's value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.loading.checkpoint import Checkpoint
from mlx_dspark.loading.weights import fill_model
from mlx_dspark.models.heads.gemma4_assistant.model import AssistantArgs, Gemma4AssistantDraft, is_assistant_config, target_text_args

TARGET_MODEL_TYPES = ("gemma4_text", "gemma4")  # mlx-lm's Gemma 4 text model and its multimodal wrapper
# load() options that shape a DSpark draft and mean nothing to an assistant
DSPARK_ONLY_OPTIONS = ("draft_tap_ids", "draft_vocab", "draft_vocab_file", "kv_bits")


def check_options(options: dict[str, Any], *, source: str) -> None:
    """Refuse, in one line, a load option that does not apply to a Gemma 4 assistant."""
    for name in DSPARK_ONLY_OPTIONS:
        if options.get(name) is not None:
            why = ("it reads the target's full-attention K/V as float rows" if name == "kv_bits"
                   else "it reads the target's final state and K/V, over the whole vocabulary")  # fmt: skip
            raise ValueError(f"{source}: {name} does not apply to a Gemma 4 assistant draft ({why}): drop it")


def check_pair(target: Any, args: AssistantArgs, *, target_source: str, draft_source: str) -> None:
    """ValueError naming the assistant's field and the target's value for a pair that cannot run."""
    kind = getattr(target, "mlx_lm_model_type", None)
    if kind not in TARGET_MODEL_TYPES:
        raise ValueError(f"{draft_source}: a Gemma 4 assistant drafts for a Gemma 4 target (model_type {list(TARGET_MODEL_TYPES)}); "
                         f"the target ({target_source}) is {kind!r}")  # fmt: skip
    text = target_text_args(target)

    def mismatch(field: str, ours: Any, theirs: Any) -> ValueError:
        return ValueError(f"{draft_source}: {field} is {ours!r} but the target ({target_source}) has {theirs!r}: they must be equal")

    if args.backbone_hidden_size != text.hidden_size:
        raise mismatch("backbone_hidden_size", args.backbone_hidden_size, text.hidden_size)
    if args.vocab_size != text.vocab_size:
        raise mismatch("text_config.vocab_size", args.vocab_size, text.vocab_size)
    if args.text["sliding_window"] != text.sliding_window:
        raise mismatch("text_config.sliding_window", args.text["sliding_window"], text.sliding_window)
    cached = text.layer_types[: text.num_hidden_layers - text.num_kv_shared_layers]
    for kind in sorted(set(args.layer_types)):
        if kind not in cached:
            raise ValueError(f"{draft_source}: text_config.layer_types has {kind} layers but the target ({target_source}) "
                             f"has no {kind} layer with a cache to read")  # fmt: skip
        full = kind == "full_attention"
        ours = args.text.get("global_head_dim") if full else args.text["head_dim"]
        theirs = (text.global_head_dim or text.head_dim) if full else text.head_dim
        if ours != theirs:
            raise mismatch("text_config.global_head_dim" if full else "text_config.head_dim", ours, theirs)
        kv_heads = text.num_global_key_value_heads if full and text.attention_k_eq_v and text.num_global_key_value_heads else text.num_key_value_heads
        if args.text["num_attention_heads"] % kv_heads:
            raise ValueError(f"{draft_source}: text_config.num_attention_heads {args.text['num_attention_heads']} is not a multiple "
                             f"of the target's {kv_heads} {kind} KV heads ({target_source})")  # fmt: skip


def build_assistant(checkpoint: Checkpoint, *, target: nn.Module, target_source: str = "target",
                    dtype: Optional[mx.Dtype] = None) -> Gemma4AssistantDraft:  # fmt: skip
    """The assistant (lazy weights), its pair with `target` checked first."""
    config, config_source = checkpoint.config, checkpoint.config_source
    args = AssistantArgs.from_dict(config, source=config_source)
    check_pair(target, args, target_source=target_source, draft_source=config_source)
    return fill_model(
        Gemma4AssistantDraft(args), config, dict(checkpoint.weights), checkpoint.origin, source=str(checkpoint.path),
        what="Gemma 4 assistant draft", dtype=checkpoint.default_dtype if dtype is None else dtype,
        config_name=Path(config_source).name,
    )  # fmt: skip


def quantize_assistant(model: nn.Module, *, bits: int, group_size: int) -> None:
    """The assistant's linear layers at the given width (norms, the tied table and the centroid ordering stay)."""
    nn.quantize(model, group_size, bits, class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0)


# -- the head's loader declarations (loading/heads/__init__.py) ---------------------------------------------
DESCRIPTION = "a Gemma 4 assistant draft"
HELP = "a Gemma 4 assistant drafter (google/gemma-4-*-it-assistant) beside a Gemma 4 target"  # --draft's help


def detect(config: dict) -> bool:
    return is_assistant_config(config)


def build(checkpoint: Checkpoint, *, target: nn.Module, target_source: str, dtype: Optional[mx.Dtype],
          options: dict[str, Any]) -> Gemma4AssistantDraft:  # fmt: skip
    check_options(options, source=checkpoint.config_source)
    return build_assistant(checkpoint, target=target, target_source=target_source, dtype=dtype)


quantize = quantize_assistant
