"""A Gemma 4 assistant drafter (`google/gemma-4-*-it-assistant`, `architectures: ["Gemma4AssistantForCausalLM"]`).

Read from transformers `models/gemma4_assistant/{configuration,modeling}_gemma4_assistant.py` and mlx-vlm
0.7.10 `speculative/drafters/gemma4_assistant/` (its round loop beside them in `speculative/`). A few Gemma 4 text
layers with no KV cache of their own: every layer is a KV-shared layer (q_proj, q_norm, o_proj only) whose
attention reads the *target's* keys and values, the last full-attention layer's for a full layer, the last
sliding layer's for a sliding one. One step, for the anchor t at position n (the target's caches hold 0 .. n-1):

    x = pre_projection([embed_target(t) * sqrt(C_b) | h])   # h (1, 1, C_b): the target's final normed state at n - 1
    for each layer (Gemma 4's sandwich-normed block, RoPE of the query at position n - 1, softmax scale 1):
        x = layer(x, K/V of the target's last layer of that type)   # full: rows 0 .. n-1; sliding: the last W of them
    y = norm(x)
    logits = lm_head(y)         # tied to the assistant's own `model.embed_tokens`; no softcap (HF's forward has none)
    h' = post_projection(y)     # (1, 1, C_b): the next step's h, beside embed_target(the draft just taken)

Every chained step keeps the same query position (n - 1) and the same target K/V (transformers'
`SinglePositionMultiTokenCandidateGenerator`, as mlx-vlm restates it); the mask is bidirectional over the rows
given, which at one query position is the target's own causal window there. `use_ordered_embeddings`
(E2B / E4B): logits only for the tokens of the `centroid_intermediate_top_k` best of `num_centroids` token
clusters (`masked_embedding.centroids`, `token_ordering`), every other token at their minimum minus one.

The layers are mlx-lm's own `gemma4_text.DecoderLayer` built with every layer KV-shared, so their parameter
names are the checkpoint's; `sanitize` drops the tensors the shared layers never read (`k_proj`, `v_proj`,
`k_norm`), the tied `lm_head` and rotary buffers, and casts `token_ordering` to int32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

from mlx_dspark.models.caches.kv import kv_rows

ARCHITECTURE = "Gemma4AssistantForCausalLM"
MODEL_TYPE = "gemma4_assistant"
LAYER_TYPES = ("full_attention", "sliding_attention")
UNUSED = (".self_attn.k_proj.", ".self_attn.v_proj.", ".self_attn.k_norm.", "rotary_emb")  # tensors shared layers never read
# Gemma 4 text features an assistant has none of (transformers' Gemma4AssistantConfig.validate_architecture)
REFUSED = {"hidden_size_per_layer_input": 0, "enable_moe_block": False, "use_double_wide_mlp": False}


def is_assistant_config(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or []) or config.get("model_type") == MODEL_TYPE


def _int(fields: dict, name: str, *, source: str, where: str = "text_config.", default: Any = None) -> int:
    value = fields.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: field '{where}{name}' must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class AssistantArgs:
    backbone_hidden_size: int  # the target's hidden size
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_intermediate_top_k: int
    tie_word_embeddings: bool
    text: dict  # the assistant's text_config, checked: what mlx-lm's gemma4_text.ModelArgs is built from

    @property
    def hidden_size(self) -> int:
        return self.text["hidden_size"]

    @property
    def vocab_size(self) -> int:
        return self.text["vocab_size"]

    @property
    def layer_types(self) -> list[str]:
        return self.text["layer_types"]

    @classmethod
    def from_dict(cls, config: dict, *, source: str = "config.json") -> "AssistantArgs":
        if not is_assistant_config(config):
            raise ValueError(f"{source}: architectures {config.get('architectures')!r} does not name {ARCHITECTURE}")
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{source}: field 'text_config' must be an object (the assistant's Gemma 4 text config), got {text!r}")
        text = dict(text)
        for name in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "head_dim", "vocab_size", "sliding_window"):
            _int(text, name, source=source)
        layers = text["num_hidden_layers"]
        for name, allowed in REFUSED.items():
            if text.get(name, allowed) not in (allowed, None):
                raise ValueError(f"{source}: field 'text_config.{name}' is {text[name]!r}; a Gemma 4 assistant has {allowed!r}")
        shared = text.get("num_kv_shared_layers") or layers  # transformers: unset / 0 means every layer
        if shared != layers:
            raise ValueError(f"{source}: field 'text_config.num_kv_shared_layers' is {shared!r}; every one of the "
                             f"{layers} assistant layers reads the target's K/V")  # fmt: skip
        if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"{source}: field 'text_config.hidden_activation' is {text['hidden_activation']!r}; Gemma 4 layers run gelu_pytorch_tanh")
        types = text.get("layer_types")
        if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"{source}: field 'text_config.layer_types' must list {layers} of {list(LAYER_TYPES)}, got {types!r}")
        rope = text.get("rope_parameters")
        if not isinstance(rope, dict) or any(not isinstance(rope.get(t), dict) for t in set(types)):
            raise ValueError(f"{source}: field 'text_config.rope_parameters' must hold an object for each of {sorted(set(types))}, got {rope!r}")
        if "full_attention" in types:
            _int(text, "global_head_dim", source=source)
        text.update(num_kv_shared_layers=layers, model_type="gemma4_text", hidden_size_per_layer_input=0,
                    enable_moe_block=False, use_double_wide_mlp=False)  # fmt: skip
        ordered = config.get("use_ordered_embeddings", False)
        if not isinstance(ordered, bool):
            raise ValueError(f"{source}: field 'use_ordered_embeddings' must be true or false, got {ordered!r}")
        centroids = _int(config, "num_centroids", source=source, where="", default=2048)
        top_k = _int(config, "centroid_intermediate_top_k", source=source, where="", default=32)
        if ordered and (text["vocab_size"] % centroids or top_k > centroids):
            raise ValueError(f"{source}: num_centroids {centroids} must divide text_config.vocab_size {text['vocab_size']} "
                             f"and be >= centroid_intermediate_top_k {top_k}")  # fmt: skip
        return cls(
            backbone_hidden_size=_int(config, "backbone_hidden_size", source=source, where=""),
            use_ordered_embeddings=ordered, num_centroids=centroids, centroid_intermediate_top_k=top_k,
            tie_word_embeddings=config.get("tie_word_embeddings", True) is not False, text=text,
        )  # fmt: skip


class MaskedEmbedding(nn.Module):
    """The E2B / E4B assistants' sparse head: dense logits over the best clusters' tokens only."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.top_k, self.num_centroids = args.centroid_intermediate_top_k, args.num_centroids
        self.centroids = nn.Linear(args.hidden_size, args.num_centroids, bias=False)
        self.token_ordering = mx.zeros((args.vocab_size,), dtype=mx.int32)  # cluster c's tokens: a contiguous run

    def __call__(self, y: mx.array, table: mx.array) -> mx.array:
        """y (B, L, C), the tied table (V, C) -> logits (B, L, V)."""
        B, L, C = y.shape
        best = mx.argpartition(self.centroids(y), kth=-self.top_k, axis=-1)[..., -self.top_k :]  # (B, L, k)
        ids = self.token_ordering.reshape(self.num_centroids, -1)[best].reshape(B, L, -1)  # (B, L, k * V / n)
        chosen = (table[ids.reshape(-1)].reshape(B, L, -1, C) @ y[..., None]).squeeze(-1)  # (B, L, k * V / n)
        floor = chosen.min(axis=-1, keepdims=True) - 1.0
        out = mx.broadcast_to(floor, (B, L, table.shape[0]))
        return mx.put_along_axis(out, ids, chosen, axis=-1)


class Backbone(nn.Module):
    def __init__(self, args: AssistantArgs, layer_args: Any):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)  # the tied head's table, not the input's
        self.layers = [gemma4_text.DecoderLayer(layer_args, i) for i in range(layer_args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=layer_args.rms_norm_eps)


class Gemma4AssistantDraft(nn.Module):
    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.args = args
        layer_args = gemma4_text.ModelArgs.from_dict(args.text)
        self.model = Backbone(args, layer_args)
        self.pre_projection = nn.Linear(2 * args.backbone_hidden_size, args.hidden_size, bias=False)
        self.post_projection = nn.Linear(args.hidden_size, args.backbone_hidden_size, bias=False)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedding(args)
        self.window = layer_args.sliding_window

    def embed(self, ids: mx.array, target: Any) -> mx.array:
        """The target's input embedding of `ids`, with Gemma's sqrt(hidden) scale (the target's own `embed_scale`)."""
        return target.embed(ids) * (self.args.backbone_hidden_size**0.5)

    def shared_kv(self, caches: Any, layer_types: list[str]) -> dict[str, tuple[mx.array, mx.array]]:
        """The target's K/V each layer type reads, from its caches now (rows 0 .. n-1 committed, nothing past them):
        the last cache-holding layer of that type (a KV-shared target layer reads the same); a sliding layer's
        last `sliding_window` rows."""
        out = {}
        for kind in set(self.args.layer_types):
            index = max(i for i in range(len(caches)) if layer_types[i] == kind)
            keys, values = kv_rows(caches[index])
            if kind == "sliding_attention":
                rows = min(self.window, caches[index].offset)
                assert keys.shape[2] >= rows, (keys.shape, rows)  # a rotating cache always holds its window
                keys, values = keys[..., -rows:, :], values[..., -rows:, :]
            out[kind] = (keys, values)
        return out

    def __call__(self, embeddings: mx.array, hidden: mx.array, shared_kv: dict, *, position: int) -> mx.array:
        """embeddings (B, 1, C_b) (`embed`), hidden (B, 1, C_b) -> the normed output y (B, 1, C) at query `position`."""
        x = self.pre_projection(mx.concatenate([embeddings, hidden.astype(embeddings.dtype)], axis=-1))
        for layer in self.model.layers:
            x, _, _ = layer(x, None, None, shared_kv=shared_kv[layer.layer_type], offset=position)
        return self.model.norm(x)

    def logits(self, y: mx.array) -> mx.array:
        if "masked_embedding" in self:
            return self.masked_embedding(y, self.model.embed_tokens.weight)
        return self.lm_head(y) if "lm_head" in self else self.model.embed_tokens.as_linear(y)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for name, value in weights.items():
            if any(part in name for part in UNUSED) or (name == "lm_head.weight" and self.args.tie_word_embeddings):
                continue
            out[name] = value.astype(mx.int32) if name == "masked_embedding.token_ordering" else value
        return out


def target_text_args(target: Any) -> Any:
    """The Gemma 4 text args of a target (under mlx-lm's multimodal wrapper, its language model's)."""
    language = getattr(target, "language_model", None)
    return getattr(language, "args", None) or target.args
