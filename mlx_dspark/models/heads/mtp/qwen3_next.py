"""Qwen3-Next's own MTP layer (`mtp.*` in a Hugging Face `Qwen3NextForCausalLM` checkpoint).

The layer is Qwen3.5's MTP (models/heads/mtp/qwen3_5.py, whose forward and conventions this module inherits) with
Qwen3-Next's decoder layer (vLLM `qwen3_next_mtp.py`, `Qwen3NextMultiTokenPredictor`):

    x = fc([pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t)])   # the embedding FIRST
    x = layers.0(x)     # a full-attention Qwen3-Next layer (gated q, q/k norms, partial RoPE) over its own KV
                        # cache, its MLP the sparse MoE with the shared expert (vLLM's rule by the layer's own
                        # index: MoE unless in mlp_only_layers or off the decoder_sparse_step)
    h = norm(x)         # -> the target's lm_head gives token_{t+2}

h_t is the target's final normed hidden state (`FINAL_TAP`); the embedding is not zeroed at position 0 (vLLM's
Qwen3-Next MTP has no such mask). The embedding and the LM head are the target's. Every norm of a raw HF file
is zero-centred (stored w - 1, vLLM's GemmaRMSNorm). A chain of k > 1 steps feeds h back beside the embedding
of the token just proposed (what vLLM's proposer keeps as the draft's hidden state).

The layer count is `num_nextn_predict_layers`, 1 when the config does not say (vLLM's default; the published
Qwen3-Next configs do not carry the field); the tensors `mtp.*` say whether the files hold them.
mlx-lm's qwen3_next sanitize drops every key containing `mtp.`; loading/heads/mtp.py takes them. The experts are
stacked by mlx-lm's qwen3_next sanitize, so the layer's layout and numerics are the target's layers'.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_next

from mlx_dspark.models.heads.mtp import qwen3_5 as mtp_qwen3_5

PREFIX = mtp_qwen3_5.PREFIX
MODEL_TYPES = ("qwen3_next",)


def declares_layers(config: dict) -> bool:
    """Whether the config itself names a positive layer count (a Hub config without it is not taken at its word)."""
    value = config.get("num_nextn_predict_layers")
    return isinstance(value, int) and value > 0


def mtp_layer_count(config: dict) -> int:
    """`num_nextn_predict_layers`; 1 when absent (vLLM's default); 0 when the config says 0."""
    value = config.get("num_nextn_predict_layers", 1)
    return int(value) if isinstance(value, int) and value > 0 else 0


def owns(config: dict, name: str) -> bool:
    return name.startswith(PREFIX)


def is_raw_hf(shapes: dict[str, Any]) -> bool:
    """Whether the MoE experts are stored one by one (mlx-lm's own test for a raw qwen3_next file, whose
    norms it then moves by + 1)."""
    return any(k.endswith(".mlp.experts.0.up_proj.weight") for k in shapes)


def mtp_args(config: dict, *, source: str = "config.json") -> mtp_qwen3_5.MTPArgs:
    if config.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"{source}: model_type {config.get('model_type')!r} is not Qwen3-Next's ({', '.join(MODEL_TYPES)})")
    layers = mtp_layer_count(config)
    if layers < 1:
        raise ValueError(f"{source}: num_nextn_predict_layers is 0: this target declares no MTP layers")
    args = qwen3_next.ModelArgs.from_dict(config)
    return mtp_qwen3_5.MTPArgs(
        hidden_size=args.hidden_size, rms_norm_eps=args.rms_norm_eps, mtp_num_hidden_layers=layers,
        layer_args=dataclasses.replace(args, full_attention_interval=1),  # every layer full attention
    )  # fmt: skip


class MTP(mtp_qwen3_5.MTP):
    """Qwen3-Next's MTP layers; `raw_norms` True for a raw HF checkpoint (experts one by one, norms w - 1)."""

    @staticmethod
    def decoder_layer(layer_args: Any, index: int) -> nn.Module:
        return qwen3_next.Qwen3NextDecoderLayer(layer_args, layer_idx=index)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Qwen3.5's renaming (`mtp.` dropped, every norm + 1 in a raw file: decided once for the checkpoint, as
        `convert` reads it shard by shard) and the experts stacked by mlx-lm's qwen3_next sanitize."""
        experts = {"model." + k.removeprefix(PREFIX): v for k, v in weights.items() if ".mlp.experts." in k}
        out = super().sanitize({k: v for k, v in weights.items() if ".mlp.experts." not in k})
        family = qwen3_next.Model(dataclasses.replace(self.args.layer_args, num_hidden_layers=self.num_layers))  # lazy, never evaluated
        out.update({key.removeprefix("model."): value for key, value in family.sanitize(experts).items()})
        return out
