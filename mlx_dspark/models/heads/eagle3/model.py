"""An EAGLE-3 draft as vLLM speculators publishes it (`speculators_model_type: eagle3`; args in eagle3_args.py).

Read from vLLM `model_executor/models/llama_eagle3.py` (and its proposer `v1/spec_decode/eagle.py`),
speculators `models/eagle3/{core,model_definitions}.py`, mlx-vlm `speculative/drafters/eagle3/eagle3.py`:

    g = fc(input_norm?([a_1 | a_2 | a_3]))     # the 3 tapped target states (B, L, 3 C_t) -> (B, L, C); input_norm iff norm_before_fc
    e = input_layernorm(embed(token))          # the token one past the state's position
    n = hidden_norm(g)
    r = n if norm_before_residual else g       # where the residual is taken
    x = r + o_proj(attn(q/k/v over [e | n]))   # q/k/v take 2C; RoPE at the state's position, over the draft's own KV cache
    h = x + mlp(post_attention_layernorm(x))   # the layer's output, pre-norm
    logits = lm_head(norm(h))                  # (B, L, draft_vocab), row i is target id d2t[i] + i; -inf elsewhere

Entry t of the draft's cache pairs the target's tapped states at t with the token at t + 1 (vLLM shifts the
input ids left by one). A chain feeds `h` itself, the pre-norm output (vLLM's `hidden_prenorm`), back in
place of g (fc is applied to target states only) beside the embedding of the token just drafted, at the
next position. Positions: vLLM uses the state's position t, speculators' training and mlx-vlm t + 1; RoPE
attention depends only on differences, so both give the same drafts.

Module attribute names are the checkpoint's (`fc`, `layers.0.*`, `norm`, `lm_head`, `input_norm`);
`sanitize` renames SpecForge's `midlayer.*` to `layers.0.*`, turns the `d2t` offsets into absolute ids
(`draft_to_target`) and drops `t2d`. The embedding is the target's unless the draft trained its own
(`embed_requires_grad`); loading/heads/eagle3.py compares a stored copy with the target's.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from mlx_dspark.models.heads.d2t import CHECKPOINT_NAME, DROPPED, PARAMETER_NAME, absolute_ids
from mlx_dspark.models.heads.eagle3.args import Eagle3Args

SPECFORGE_PREFIX = "midlayer."  # SpecForge's name for the one layer


def canonical_name(name: str) -> str:
    """A checkpoint tensor name as the model's parameter: SpecForge's `midlayer.*` is `layers.0.*`, `d2t` the ids."""
    if name.startswith(SPECFORGE_PREFIX):
        return "layers.0." + name[len(SPECFORGE_PREFIX):]
    return PARAMETER_NAME if name == CHECKPOINT_NAME else name


class Attention(nn.Module):
    """Llama attention (qwen3: per-head q/k RMSNorms) whose q/k/v read the 2C input [embedding | hidden]."""

    def __init__(self, args: Eagle3Args):
        super().__init__()
        C, H, KV, D = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.n_heads, self.n_kv_heads, self.scale = H, KV, D**-0.5
        self.q_proj = nn.Linear(2 * C, H * D, bias=args.attention_bias)
        self.k_proj = nn.Linear(2 * C, KV * D, bias=args.attention_bias)
        self.v_proj = nn.Linear(2 * C, KV * D, bias=args.attention_bias)
        self.o_proj = nn.Linear(H * D, C, bias=args.attention_bias)
        if args.layer_type == "qwen3":
            self.q_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.rope = initialize_rope(D, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings)

    def project(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys, values (B, heads, L, D) of inputs (B, L, 2C) at positions offset .., RoPE applied."""
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if "q_norm" in self:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)  # (B, H, L, D)
        return self.rope(queries, offset=offset), self.rope(keys, offset=offset), values

    def __call__(self, x: mx.array, mask: Any, cache: Optional[KVCache]) -> mx.array:
        B, L, _ = x.shape
        queries, keys, values = self.project(x, 0 if cache is None else cache.offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: Eagle3Args):
        super().__init__()
        C, inner = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(C, inner, bias=args.mlp_bias)
        self.up_proj = nn.Linear(C, inner, bias=args.mlp_bias)
        self.down_proj = nn.Linear(inner, C, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """EAGLE-3's one decoder layer: attention over [input_layernorm(embedding) | hidden_norm(hidden)]."""

    def __init__(self, args: Eagle3Args):
        super().__init__()
        C, eps = args.hidden_size, args.rms_norm_eps
        self.norm_before_residual = args.norm_before_residual
        self.input_layernorm = nn.RMSNorm(C, eps=eps)
        self.hidden_norm = nn.RMSNorm(C, eps=eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = nn.RMSNorm(C, eps=eps)
        self.mlp = MLP(args)

    def __call__(self, embeddings: mx.array, hidden: mx.array, mask: Any, cache: Optional[KVCache]) -> mx.array:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = mx.concatenate([self.input_layernorm(embeddings), normed], axis=-1)  # (B, L, 2C)
        h = residual + self.self_attn(x, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, args: Eagle3Args):
        super().__init__()
        self.args = args
        C = args.hidden_size
        if args.norm_before_fc:
            self.input_norm = nn.RMSNorm(3 * args.target_hidden_size, eps=args.rms_norm_eps)
        self.fc = nn.Linear(3 * args.target_hidden_size, C, bias=False)
        self.layers = [Layer(args)]
        self.norm = nn.RMSNorm(C, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(C, args.draft_vocab_size, bias=False)
        if args.own_embedding:
            self.embed_tokens = nn.Embedding(args.vocab_size, C)
        if args.reduced_vocab:
            setattr(self, PARAMETER_NAME, mx.zeros((args.draft_vocab_size,), dtype=mx.int32))  # absolute target ids

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def fuse(self, features: mx.array) -> mx.array:
        """The tapped target states (B, L, 3 C_t) -> g (B, L, C)."""
        if "input_norm" in self:
            features = self.input_norm(features)
        return self.fc(features)

    def embed(self, ids: mx.array, target: Any) -> mx.array:
        return self.embed_tokens(ids) if "embed_tokens" in self else target.embed(ids)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: Optional[list[KVCache]] = None) -> mx.array:
        """embeddings (B, L, C) of tokens t+1, hidden (B, L, C) (g, or a step's own output) -> pre-norm outputs (B, L, C)."""
        cache = cache or [None]
        hidden = hidden.astype(embeddings.dtype)
        return self.layers[0](embeddings, hidden, create_attention_mask(hidden, cache[0]), cache[0])

    def logits(self, h: mx.array) -> mx.array:
        """Pre-norm outputs (B, L, C) -> logits over the target vocabulary (B, L, V), -inf outside the draft's rows."""
        draft = self.lm_head(self.norm(h))
        if not self.args.reduced_vocab:
            return draft
        full = mx.full((*draft.shape[:-1], self.args.vocab_size), -mx.inf, dtype=draft.dtype)
        full[..., getattr(self, PARAMETER_NAME)] = draft
        return full

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """SpecForge's `midlayer.*` as `layers.0.*`; `d2t` offsets as absolute ids; `t2d` dropped."""
        args, out = self.args, {}
        for name, value in weights.items():
            if name in DROPPED:
                continue
            name = canonical_name(name)
            if name == PARAMETER_NAME:
                offsets = np.array(value)
                if not args.reduced_vocab and offsets.size == args.vocab_size and not offsets.any():
                    continue  # the identity map of a full-vocabulary draft
                ids = absolute_ids(offsets, vocab_size=args.vocab_size, draft_vocab_size=args.draft_vocab_size, source="the EAGLE-3 draft")
                value = mx.array(ids)
            out[name] = value
        return out
