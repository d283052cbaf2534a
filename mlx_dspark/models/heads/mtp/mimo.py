"""Xiaomi MiMo's own MTP layers, as its Hugging Face checkpoints carry them (`MiMoForCausalLM`).

The config says `num_nextn_predict_layers` (n); layer i sits at `model.mtp_layers.<i>.*` and holds
(DRAFTERS.md section 2; vLLM `mimo_mtp.py`, MiMo's own `modeling_mimo.py`):

    token_layernorm, hidden_layernorm   RMSNorms of the embedding and of the incoming hidden state
    input_proj                          [C, 2C], no bias
    final_layernorm                     the RMSNorm the layer ends with
    the rest                            one Qwen2 decoder block (q/k/v with biases, RoPE, SwiGLU), under the
                                        same prefix (vLLM renames it to `mtp_block`, as we do)

The layer has no embedding or LM head of its own: vLLM reads the target's `model.embed_tokens` and
`lm_head`. One step at position t (vLLM `MiMoMultiTokenPredictorLayer.forward`):

    e = embed(token_{t+1}), zeroed at position 0            # vLLM: "masking inputs at position 0"
    x = input_proj(concat[hidden_layernorm(h_t), token_layernorm(e)])   # the hidden state FIRST (DeepSeek: last)
    h = final_layernorm(block(x))   # over its own KV cache, entry t at RoPE position t; vLLM adds the block's
                                    # residual back, which mlx-lm's layer returns already summed
    logits = lm_head(h)             # token_{t+2}

h_t is the target's final normed hidden state (`FINAL_TAP`). vLLM drafts one token per round with it
(`spec_step_idx` must be 0). Our chain of k > 1 steps feeds the layer's returned state h (normed: what
vLLM's proposer keeps as a draft model's hidden states, and what the Qwen MTP chain feeds back) beside
the embedding of the token just proposed; step k uses layer k mod n.

mlx-lm's mimo sanitize drops every `model.mtp_layers.` tensor from the target; `loading/heads/mtp.py` takes them.
The block is mlx-lm's own mimo `TransformerBlock`, so its numerics are the target's layers'.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import mimo
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlx_dspark.models.heads.mtp.layers import MTPLayers

PREFIX = "model.mtp_layers."
MODEL_TYPES = ("mimo",)
OWN_PARTS = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")  # the rest is the block


def mtp_layer_count(config: dict) -> int:
    """How many MTP layers a config declares (`num_nextn_predict_layers`; 0: none)."""
    value = config.get("num_nextn_predict_layers", 0)
    return int(value) if isinstance(value, int) and value > 0 else 0


def layer_prefixes(config: dict) -> tuple[str, ...]:
    return tuple(f"{PREFIX}{i}." for i in range(mtp_layer_count(config)))


def owns(config: dict, name: str) -> bool:
    """Whether a checkpoint tensor belongs to the MTP layers the config declares."""
    return name.startswith(layer_prefixes(config)) if mtp_layer_count(config) else False


@dataclass
class MiMoMTPArgs:
    hidden_size: int
    rms_norm_eps: float
    num_nextn_predict_layers: int
    layer_args: mimo.ModelArgs  # the target's

    @classmethod
    def from_dict(cls, config: dict, *, source: str = "config.json") -> "MiMoMTPArgs":
        if config.get("model_type") not in MODEL_TYPES:
            raise ValueError(f"{source}: model_type {config.get('model_type')!r} is not MiMo's ({', '.join(MODEL_TYPES)})")
        layers = mtp_layer_count(config)
        if layers < 1:
            raise ValueError(f"{source}: num_nextn_predict_layers is missing or 0: this target declares no MTP layers")
        args = mimo.ModelArgs.from_dict(config)
        return cls(args.hidden_size, args.rms_norm_eps, layers, args)


class MTPLayer(nn.Module):
    def __init__(self, args: MiMoMTPArgs):
        super().__init__()
        C, eps = args.hidden_size, args.rms_norm_eps
        self.token_layernorm = nn.RMSNorm(C, eps=eps)
        self.hidden_layernorm = nn.RMSNorm(C, eps=eps)
        self.input_proj = nn.Linear(2 * C, C, bias=False)
        self.mtp_block = mimo.TransformerBlock(args.layer_args)
        self.final_layernorm = nn.RMSNorm(C, eps=eps)


class MTP(MTPLayers):
    """MiMo's MTP layers; the embedding and the LM head are the target's."""

    own_embedding = own_head = False  # MiMo's layers carry no copies (the interface of mtp_deepseek.MTP)

    def __init__(self, args: MiMoMTPArgs):
        super().__init__()
        self.args = args
        self.layers = [MTPLayer(args) for _ in range(args.num_nextn_predict_layers)]

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: Optional[list[KVCache]] = None, *, step: int = 0) -> mx.array:
        """embeddings (B, L, C) of tokens t+1, hidden (B, L, C) states at t -> normed outputs (B, L, C),
        through layer `step` mod n and its cache."""
        layer, c, embeddings = self.step_inputs(embeddings, cache, step)
        x = mx.concatenate([layer.hidden_layernorm(hidden.astype(embeddings.dtype)), layer.token_layernorm(embeddings)], axis=-1)  # (B, L, 2C)
        x = layer.input_proj(x)
        h = layer.mtp_block(x, create_attention_mask(x, c), c)
        return layer.final_layernorm(h)

    def logits(self, h: mx.array, target: Any, *, step: int = 0) -> mx.array:
        """(B, L, C) normed outputs -> (B, L, V) by the target's LM head."""
        return target.lm_head_logits(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint names (HF's, which our conversion keeps) -> ours; the blocks go through mlx-lm's own
        mimo sanitize (it drops `rotary_emb.inv_freq`), one layer at a time."""
        out: dict[str, mx.array] = {}
        family = mimo.Model(replace(self.args.layer_args, num_hidden_layers=1))  # lazy parameters, never evaluated
        for i in range(self.num_layers):
            prefix = f"{PREFIX}{i}."
            block = {}
            for name, value in weights.items():
                if not name.startswith(prefix):
                    continue
                key = name[len(prefix):]
                if key.startswith(OWN_PARTS):
                    out[f"layers.{i}.{key}"] = value
                else:
                    block[f"model.layers.0.{key}"] = value
            for key, value in family.sanitize(block).items():
                out[f"layers.{i}.mtp_block.{key[len('model.layers.0.'):]}"] = value
        return out

    def checkpoint_name(self, name: str) -> str:
        """Our parameter name -> the name a conversion writes (HF's)."""
        _, index, rest = name.split(".", 2)
        return f"{PREFIX}{index}.{rest.removeprefix('mtp_block.')}"
