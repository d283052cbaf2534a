"""DeepSeek-V3's and GLM-4.5's own next-n (MTP) layers, as their Hugging Face checkpoints carry them.

The config says `num_nextn_predict_layers` (n); layer i sits after the target's layers, at
`model.layers.<num_hidden_layers + i>.*` (DeepSeek-V3: 61, GLM-4.5: 92), and holds (DRAFTERS.md
section 2; vLLM `deepseek_mtp.py` / `glm4_moe_mtp.py`, their `_rewrite_spec_layer_name`):

    embed_tokens        a copy of the target's embedding, may be absent (then the target's is used);
                        vLLM reads it from the first next-n layer only
    enorm, hnorm        RMSNorms of the embedding and of the incoming hidden state
    eh_proj             [C, 2C], no bias
    shared_head.norm    the RMSNorm before the head
    shared_head.head    a copy of the target's lm_head, may be absent (then the target's is used)
    the rest            one full decoder block of the family (DeepSeek: MLA attention + MoE; GLM: GQA with
                        partial RoPE + MoE), built here with mlx-lm's own layer class at layer index
                        num_hidden_layers + i, so it is MoE or dense exactly as vLLM builds it

One step at position t (vLLM `DeepSeekMultiTokenPredictorLayer.forward`):

    e = embed(token_{t+1}), zeroed at position 0        # vLLM: "masking inputs at position 0"
    x = eh_proj(concat[enorm(e), hnorm(h_t)])           # the embedding first, then the hidden state
    h = block(x)        # over its own KV cache; entry t at RoPE position t. vLLM returns residual + output,
                        # the block's pre-norm output, which mlx-lm's layer returns as is
    logits = head(shared_head.norm(h))                  # token_{t+2}

h_t is what the target's model returns, its final *normed* hidden state (vLLM's `DeepseekV2Model.forward`
ends in `self.norm`; the proposer hands that over as `previous_hidden_states`): the package's
`FINAL_TAP`. A chain of k > 1 steps feeds the step's *pre-norm* output h back as the next hidden state
(vLLM's proposer keeps the draft model's returned hidden states, not the normed ones) beside the
embedding of the token just proposed; step k uses layer k mod n (`spec_step_idx % num_mtp_layers`).

mlx-lm's sanitize of both families drops these layers from the target (DeepSeek: names starting
`model.layers.61`; GLM: `model.layers.<num_hidden_layers>`); `loading/heads/mtp.py` takes them first.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlx_dspark.models.heads.mtp.layers import MTPLayers

# model_type -> (mlx-lm's decoder layer class, whether the family's model asks for an array mask)
FAMILIES = {"deepseek_v3": ("DeepseekV3DecoderLayer", True), "glm4_moe": ("DecoderLayer", False)}
MODEL_TYPES = tuple(FAMILIES)
OWN_PARTS = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")  # the rest of a next-n layer is its block


def nextn_layer_count(config: dict) -> int:
    """How many next-n layers a config declares (`num_nextn_predict_layers`; 0: none)."""
    value = config.get("num_nextn_predict_layers", 0)
    return int(value) if isinstance(value, int) and value > 0 else 0


def layer_prefixes(config: dict) -> tuple[str, ...]:
    """The checkpoint prefixes of the next-n layers, `model.layers.<num_hidden_layers + i>.`."""
    first = int(config["num_hidden_layers"])
    return tuple(f"model.layers.{first + i}." for i in range(nextn_layer_count(config)))


def owns(config: dict, name: str) -> bool:
    """Whether a checkpoint tensor belongs to the next-n layers."""
    return name.startswith(layer_prefixes(config)) if nextn_layer_count(config) else False


def _family(model_type: str) -> Any:
    return importlib.import_module(f"mlx_lm.models.{model_type}")


@dataclass
class NextNArgs:
    model_type: str
    hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    num_hidden_layers: int
    num_nextn_predict_layers: int
    layer_args: Any  # mlx-lm's ModelArgs of the target's family

    @classmethod
    def from_dict(cls, config: dict, *, source: str = "config.json") -> "NextNArgs":
        model_type = config.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"{source}: model_type {model_type!r} has no next-n layers we build (supported: {', '.join(FAMILIES)})")
        layers = nextn_layer_count(config)
        if layers < 1:
            raise ValueError(f"{source}: num_nextn_predict_layers is missing or 0: this target declares no MTP layers")
        args = _family(model_type).ModelArgs.from_dict(config)
        return cls(model_type, args.hidden_size, args.vocab_size, args.rms_norm_eps, args.num_hidden_layers, layers, args)


class SharedHead(nn.Module):
    def __init__(self, args: NextNArgs, *, own_head: bool):
        super().__init__()
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if own_head:
            self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)


class NextNLayer(nn.Module):
    def __init__(self, args: NextNArgs, index: int, *, own_head: bool):
        super().__init__()
        C, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(C, eps=eps)
        self.hnorm = nn.RMSNorm(C, eps=eps)
        self.eh_proj = nn.Linear(2 * C, C, bias=False)
        self.shared_head = SharedHead(args, own_head=own_head)
        layer_class = getattr(_family(args.model_type), FAMILIES[args.model_type][0])
        self.block = layer_class(args.layer_args, layer_idx=args.num_hidden_layers + index)


class MTP(MTPLayers):
    """The next-n layers; `own_embedding` / `own_head`: whether the checkpoint carries its copies of the
    target's embedding / LM head (else the target's are used)."""

    def __init__(self, args: NextNArgs, *, own_embedding: bool = True, own_head: bool = True):
        super().__init__()
        self.args = args
        self.own_embedding, self.own_head = own_embedding, own_head
        if own_embedding:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [NextNLayer(args, i, own_head=own_head) for i in range(args.num_nextn_predict_layers)]

    def embed(self, ids: mx.array, target: Any) -> mx.array:
        return self.embed_tokens(ids) if self.own_embedding else target.embed(ids)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: Optional[list[KVCache]] = None, *, step: int = 0) -> mx.array:
        """embeddings (B, L, C) of tokens t+1, hidden (B, L, C) states at t -> pre-norm outputs (B, L, C),
        through layer `step` mod n and its cache."""
        layer, c, embeddings = self.step_inputs(embeddings, cache, step)
        x = mx.concatenate([layer.enorm(embeddings), layer.hnorm(hidden.astype(embeddings.dtype))], axis=-1)  # (B, L, 2C)
        x = layer.eh_proj(x)
        mask = create_attention_mask(x, c, return_array=FAMILIES[self.args.model_type][1])
        return layer.block(x, mask, c)

    def logits(self, h: mx.array, target: Any, *, step: int = 0) -> mx.array:
        """(B, L, C) pre-norm outputs of step `step` -> (B, L, V): shared_head.norm, then its head."""
        head = self.layers[step % len(self.layers)].shared_head
        normed = head.norm(h)
        return head.head(normed) if self.own_head else target.lm_head_logits(normed)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint names (HF, or our conversion's, which keeps them) -> ours. Each next-n layer's tensors
        but the embedding go through mlx-lm's own sanitize of the family, one layer at a time: fp8 / int4
        dequantization (an FP8 checkpoint's `eh_proj` and head carry their `weight_scale_inv` too), experts
        stacked into switch_mlp, DeepSeek's kv_b_proj split into embed_q / unembed_out."""
        first = self.args.num_hidden_layers
        out: dict[str, mx.array] = {}
        for i in range(self.num_layers):
            prefix = f"model.layers.{first + i}."
            layer = {}
            for name, value in weights.items():
                if not name.startswith(prefix):
                    continue
                key = name[len(prefix):]
                if key.startswith("embed_tokens."):
                    if i == 0:  # vLLM: the embedding is shared, read from the first next-n layer
                        out[key] = value
                else:
                    layer[f"model.layers.0.{key}"] = value
            for key, value in _one_layer_model(self.args).sanitize(layer).items():
                key = key[len("model.layers.0."):]
                out[f"layers.{i}.{key}" if key.startswith(OWN_PARTS) else f"layers.{i}.block.{key}"] = value
        return out

    def checkpoint_name(self, name: str) -> str:
        """Our parameter name -> the name a conversion writes (HF's, the block's in mlx-lm's form)."""
        if name.startswith("embed_tokens."):
            return f"model.layers.{self.args.num_hidden_layers}.{name}"
        _, index, rest = name.split(".", 2)
        return f"model.layers.{self.args.num_hidden_layers + int(index)}.{rest.removeprefix('block.')}"


def _one_layer_model(args: NextNArgs) -> nn.Module:
    """mlx-lm's model of the family with one layer, whose `sanitize` renames a block's tensors named as
    layer 0 (its parameters are lazy and never evaluated)."""
    return _family(args.model_type).Model(replace(args.layer_args, num_hidden_layers=1))
