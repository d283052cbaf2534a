"""Nemotron-H's own MTP block (`mtp.layers.<j>.*` in a Hugging Face `NemotronHForCausalLM` checkpoint:
NVIDIA's Nemotron 3 Super / Nemotron 3.5 configs declare `num_nextn_predict_layers: 1`).

The config says `num_nextn_predict_layers` (n; vLLM runs 1 and only 1) and the block's layer kinds:
`mtp_layers_block_type` (HF transformers' list, default ["attention", "moe"]) or the older
`mtp_hybrid_override_pattern` ("*E"). One step is a small stack of Nemotron-H blocks, j = 0 .. len(pattern) - 1
(vLLM `nemotron_h_mtp.py`, `NemotronHMultiTokenPredictor`):

    e = embed(token_{t+1})                                   # the target's `backbone.embeddings`, not zeroed at 0
    x = eh_proj(concat[enorm(e), hnorm(h_t)])                # layer 0's own parts, the embedding FIRST, [C, 2C]
    x = x + mixer_j(norm_j(x))   for each j                  # '*': attention (no RoPE: Nemotron-H's attention has
                                                             # none) over its own KV cache; 'E': the routed MoE
    h = final_layernorm(x)                                   # the last layer's own part
    logits = lm_head(h)                                      # the target's head: token_{t+2}

h_t is the target's final normed hidden state (`backbone.norm_f`, `FINAL_TAP`). Norms are plain RMSNorms
(weights stored as they act). A chain of k > 1 steps feeds h back beside the embedding of the token just
proposed (vLLM's proposer keeps the MTP's returned state). Each layer is mlx-lm's own `NemotronHBlock`, so its
numerics are the target's blocks'; mlx-lm's nemotron_h sanitize drops every `mtp.` key from the target and
stacks the MTP's experts here (its own sanitize, on the block's tensors).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import nemotron_h
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlx_dspark.models.heads.mtp.layers import MTPLayers

PREFIX = "mtp.layers."
MODEL_TYPES = ("nemotron_h",)
BLOCK_CHARS = {"attention": "*", "moe": "E"}  # the kinds vLLM builds (its NemotronHMTP refuses any other)
DEFAULT_BLOCK_TYPES = ["attention", "moe"]  # HF transformers' NemotronHConfig default


def mtp_layer_count(config: dict) -> int:
    """How many MTP steps' blocks the config declares (`num_nextn_predict_layers`; 0: none)."""
    value = config.get("num_nextn_predict_layers", 0)
    return int(value) if isinstance(value, int) and value > 0 else 0


def block_pattern(config: dict, *, source: str = "config.json") -> str:
    """The MTP block's layer kinds as mlx-lm's characters ("*E")."""
    types = config.get("mtp_layers_block_type")
    pattern = config.get("mtp_hybrid_override_pattern")
    if (types is None or types == DEFAULT_BLOCK_TYPES) and isinstance(pattern, str):  # HF's precedence
        return pattern
    types = DEFAULT_BLOCK_TYPES if types is None else types
    if not isinstance(types, list) or not types or any(t not in BLOCK_CHARS for t in types):
        raise ValueError(f"{source}: mtp_layers_block_type {types!r}: the MTP block runs 'attention' and 'moe' layers only (vLLM's)")
    return "".join(BLOCK_CHARS[t] for t in types)


def layer_prefixes(config: dict) -> tuple[str, ...]:
    if not mtp_layer_count(config):
        return ()
    try:
        return tuple(f"{PREFIX}{j}." for j in range(len(block_pattern(config))))
    except ValueError:
        return (PREFIX,)  # a malformed pattern: the tensors are still the MTP's (build says what is wrong)


def owns(config: dict, name: str) -> bool:
    return name.startswith(PREFIX)


@dataclass
class NemotronHMTPArgs:
    hidden_size: int
    layer_norm_epsilon: float
    pattern: str
    layer_args: nemotron_h.ModelArgs  # the target's

    @classmethod
    def from_dict(cls, config: dict, *, source: str = "config.json") -> "NemotronHMTPArgs":
        if config.get("model_type") not in MODEL_TYPES:
            raise ValueError(f"{source}: model_type {config.get('model_type')!r} is not Nemotron-H's ({', '.join(MODEL_TYPES)})")
        if mtp_layer_count(config) < 1:
            raise ValueError(f"{source}: num_nextn_predict_layers is missing or 0: this target declares no MTP layers")
        pattern = block_pattern(config, source=source)
        if set(pattern) - set(BLOCK_CHARS.values()):
            raise ValueError(f"{source}: mtp_hybrid_override_pattern {pattern!r}: the MTP block runs '*' and 'E' layers only (vLLM's)")
        args = nemotron_h.ModelArgs.from_dict(config)
        if "E" in pattern and not args.n_routed_experts:
            raise ValueError(f"{source}: the MTP block has a MoE layer but n_routed_experts is missing")
        return cls(args.hidden_size, args.layer_norm_epsilon, pattern, args)


class MTPBlock(nemotron_h.NemotronHBlock):
    """One Nemotron-H block of the MTP; the first carries the input projection, the last the final norm."""

    def __init__(self, args: NemotronHMTPArgs, kind: str, *, first: bool, last: bool):
        super().__init__(args.layer_args, kind)
        C, eps = args.hidden_size, args.layer_norm_epsilon
        if first:
            self.enorm = nn.RMSNorm(C, eps=eps)
            self.hnorm = nn.RMSNorm(C, eps=eps)
            self.eh_proj = nn.Linear(2 * C, C, bias=False)
        if last:
            self.final_layernorm = nn.RMSNorm(C, eps=eps)


class MTP(MTPLayers):
    """Nemotron-H's MTP block; the embedding and the LM head are the target's."""

    own_embedding = own_head = False

    def __init__(self, args: NemotronHMTPArgs):
        super().__init__()
        self.args = args
        last = len(args.pattern) - 1
        self.layers = [MTPBlock(args, kind, first=j == 0, last=j == last) for j, kind in enumerate(args.pattern)]

    @property
    def num_layers(self) -> int:
        return 1  # one MTP step's block (its Nemotron-H layers are its parts)

    def make_cache(self) -> list[KVCache]:
        """One KV cache per attention layer (the MoE layers keep none)."""
        return [KVCache() for layer in self.layers if layer.block_type == "*"]

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: Optional[list[KVCache]] = None, *, step: int = 0) -> mx.array:
        """embeddings (B, L, C) of tokens t+1, hidden (B, L, C) normed states at t -> normed outputs (B, L, C)."""
        first = self.layers[0]
        x = mx.concatenate([first.enorm(embeddings), first.hnorm(hidden.astype(embeddings.dtype))], axis=-1)  # (B, L, 2C)
        x = first.eh_proj(x)
        caches = iter(cache or [])
        attention = [layer for layer in self.layers if layer.block_type == "*"]
        mask = create_attention_mask(x, cache[0] if cache else None) if attention else None
        for layer in self.layers:
            x = layer(x, mask=mask, cache=next(caches, None) if layer.block_type == "*" else None)
        return self.layers[-1].final_layernorm(x)

    def logits(self, h: mx.array, target: Any, *, step: int = 0) -> mx.array:
        return target.lm_head_logits(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """`mtp.layers.<j>.*` -> `layers.<j>.*`, through mlx-lm's own nemotron_h sanitize (it stacks the experts
        into `switch_mlp.fc1 / fc2`) with the MTP's pattern as the layer stack."""
        family = nemotron_h.Model(dataclasses.replace(self.args.layer_args, hybrid_override_pattern=list(self.args.pattern),
                                                      num_hidden_layers=len(self.args.pattern)))  # fmt: skip
        renamed = {"backbone.layers." + k.removeprefix(PREFIX): v for k, v in weights.items() if k.startswith(PREFIX)}
        return {k.removeprefix("backbone."): v for k, v in family.sanitize(renamed).items()}

    def checkpoint_name(self, name: str) -> str:
        """Our parameter name -> the name a conversion writes (HF's)."""
        return "mtp." + name
