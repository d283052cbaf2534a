"""The DSpark draft (DSPARK.md section 3): context fusion, one block forward, Markov and confidence heads.

The draft attends from a block `[anchor, mask x (block_size - 1)]` at positions `p .. p+block_size-1`
to the fused target features of the committed positions (`c(t) = hidden_norm(fc(f(t)))`, projected
to K/V once per position and cached) and to the block itself, without a causal mask. Output row `k-1`
of the block predicts the token at `p + k`. Layers follow the family of the draft: qwen3 (DeepSpec's
`Qwen3DSparkModel`) or spark2_5 (fused `q_k_v_proj`, head-wise sigmoid gate, partial RoPE, GELU).
The draft never owns the embedding or the LM head: it calls `target.embed` / `target.lm_head_logits`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dspark.draft_cache import ContextCache
from mlx_dspark.models import draft_family
from mlx_dspark.models.base import LAYER_TYPES, SLIDING_ATTENTION, RoPE, check_rope_default, gelu, rotary_dims
from mlx_dspark.models.dspark_heads import MARKOV_HEAD_TYPES, ConfidenceHead, Proposal, draft_tokens, make_markov_head

# Frozen copies of the target's tensors that DeepSpec saves in the draft; the draft shares the target's.
SHARED_PREFIXES = ("embed_tokens.", "embedding.", "lm_head.")


@dataclass
class DraftArgs:
    family: str  # "qwen3" or "spark2_5": the layer conventions
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    attention_bias: bool
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    markov_rank: int
    markov_head_type: Optional[str]
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    layer_types: list[str]
    sliding_window: Optional[int]  # the window of sliding layers, None when no layer slides
    rope: dict[str, tuple[float, int]]  # layer type -> (theta, rotary dims)
    confidence_temperatures: Optional[list[float]] = None  # per block position, fitted by calibration

    @classmethod
    def from_dict(cls, config: dict, *, source: str = "config.json") -> "DraftArgs":
        family = draft_family(config, source=source)
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
            + ("block_size", "target_layer_ids", "mask_token_id", "markov_rank", "enable_confidence_head", "layer_types")
            if config.get(k) is None
        ]
        if missing:
            raise ValueError(f"{source}: missing field(s) {missing} for a {family} DSpark draft")

        def int_field(name: str, value: Any, *, low: int) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{source}: field {name!r} must be an integer >= {low}, got {value!r}")
            return value

        heads = int_field("num_attention_heads", config["num_attention_heads"], low=1)
        kv_heads = int_field("num_key_value_heads", config.get("num_key_value_heads", heads), low=1)
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        hidden = int_field("hidden_size", config["hidden_size"], low=1)
        head_dim = int_field("head_dim", config.get("head_dim") or hidden // heads, low=1)
        num_layers = int_field("num_hidden_layers", config["num_hidden_layers"], low=1)
        block_size = int_field("block_size", config["block_size"], low=1)
        markov_rank = int_field("markov_rank", config["markov_rank"], low=0)
        ids = config["target_layer_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= -1 for i in ids):
            raise ValueError(f"{source}: field 'target_layer_ids' must be a non-empty list of layer ids >= -1, got {ids!r}")

        head_type = config.get("markov_head_type")
        if markov_rank > 0 and head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"{source}: field 'markov_head_type' is {head_type!r}; expected one of {list(MARKOV_HEAD_TYPES)} "
                f"(markov_rank is {markov_rank})"
            )
        confidence = bool(config["enable_confidence_head"])
        with_markov = bool(config.get("confidence_head_with_markov", False))
        if confidence and "confidence_head_with_markov" not in config:
            raise ValueError(f"{source}: field 'confidence_head_with_markov' is missing (enable_confidence_head is true)")
        if confidence and with_markov and markov_rank == 0:
            raise ValueError(f"{source}: confidence_head_with_markov needs a Markov head, but markov_rank is 0")

        layer_types = config["layer_types"]
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ValueError(f"{source}: field 'layer_types' must list {num_layers} entries (num_hidden_layers), got {layer_types!r}")
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"{source}: layer_types has unknown entries {unknown}; expected {list(LAYER_TYPES)}")
        window = config.get("sliding_window")
        if family == "qwen3" and config.get("use_sliding_window") is False:
            window = None  # as transformers' Qwen3Config, which DeepSpec's draft reads: no window at all
        if window is not None:
            window = int_field("sliding_window", window, low=1)
        elif family == "spark2_5" and SLIDING_ATTENTION in layer_types:
            raise ValueError(f"{source}: field 'sliding_window' is missing but layer_types has sliding_attention layers")

        if family == "spark2_5":
            # Our Spark layout has one sigmoid gate per query head (g_proj: hidden -> heads).
            if config.get("gate_attn_act_mode", "sigmoid") != "sigmoid" or config.get("headwise_attn_output_gate") is False:
                raise ValueError(
                    f"{source}: only a head-wise sigmoid attention output gate is supported; got gate_attn_act_mode "
                    f"{config.get('gate_attn_act_mode')!r}, headwise_attn_output_gate {config.get('headwise_attn_output_gate')!r}"
                )
        rope = _rope_by_layer_type(config, family=family, head_dim=head_dim, layer_types=layer_types, source=source)
        temperatures = config.get("confidence_temperatures")
        if temperatures is not None and (
            not confidence
            or not isinstance(temperatures, list)
            or len(temperatures) != block_size
            or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in temperatures)
        ):
            raise ValueError(
                f"{source}: field 'confidence_temperatures' must be a list of {block_size} positive numbers "
                f"(one per block position) on a draft with a confidence head, got {temperatures!r}"
            )
        act = config.get("hidden_act")
        expected_act = {"qwen3": "silu", "spark2_5": "gelu"}[family]
        if act is not None and act != expected_act:
            raise ValueError(f"{source}: hidden_act {act!r} is not supported for a {family} draft; expected {expected_act!r}")
        return cls(
            family=family,
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int_field("intermediate_size", config["intermediate_size"], low=1),
            vocab_size=int_field("vocab_size", config["vocab_size"], low=1),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(config.get("attention_bias", False)),
            block_size=block_size,
            target_layer_ids=list(ids),
            mask_token_id=int_field("mask_token_id", config["mask_token_id"], low=0),
            markov_rank=markov_rank,
            markov_head_type=head_type if markov_rank > 0 else None,
            enable_confidence_head=confidence,
            confidence_head_with_markov=confidence and with_markov,
            layer_types=list(layer_types),
            sliding_window=window,
            rope=rope,
            confidence_temperatures=None if temperatures is None else [float(t) for t in temperatures],
        )

    def layer_window(self, layer: int) -> Optional[int]:
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None


def _rope_by_layer_type(
    config: dict, *, family: str, head_dim: int, layer_types: list[str], source: str
) -> dict[str, tuple[float, int]]:
    params = config.get("rope_parameters") or {}
    if family == "qwen3":
        # One full-rotary RoPE for every layer (DeepSpec shares one rotary embedding).
        check_rope_default(config.get("rope_scaling"), field="rope_scaling", source=source)
        check_rope_default(params, field="rope_parameters", source=source)
        theta = config.get("rope_theta") or params.get("rope_theta")
        if theta is None:
            raise ValueError(f"{source}: field 'rope_theta' (or 'rope_parameters.rope_theta') is missing")
        return {t: (float(theta), head_dim) for t in set(layer_types)}
    rope = {}
    for layer_type in set(layer_types):
        entry = params.get(layer_type)
        if not isinstance(entry, dict) or entry.get("rope_theta") is None:
            raise ValueError(f"{source}: field 'rope_parameters.{layer_type}.rope_theta' is missing")
        check_rope_default(entry, field=f"rope_parameters.{layer_type}", source=source)
        factor = float(entry.get("partial_rotary_factor", 1.0))
        rope[layer_type] = (float(entry["rope_theta"]), rotary_dims(head_dim, factor, source=source))
    return rope


def block_mask(p: int, num_queries: int, num_context: int, window: Optional[int]) -> Optional[mx.array]:
    """Boolean (L, n + L) mask of a block at `p .. p+L-1` over context `p-n .. p-1` then the block.

    The block sees itself entirely; a query `q` sees context `t` iff `q - t < window`. None when
    nothing is masked.
    """
    if window is None or num_queries - 1 + num_context < window:
        return None
    q_pos = mx.arange(p, p + num_queries)[:, None]
    t_pos = mx.arange(p - num_context, p)[None]
    context = t_pos > q_pos - window
    return mx.concatenate([context, mx.ones((num_queries, num_queries), dtype=mx.bool_)], axis=1)


class Qwen3Attention(nn.Module):
    def __init__(self, args: DraftArgs, layer_type: str):
        super().__init__()
        dim, self.heads, self.kv_heads, head_dim = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        theta, dims = args.rope[layer_type]
        self.rope = RoPE(dims, base=theta)

    def key_values(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """K (k_norm, RoPE from `offset`) and V of rows x (B, n, H) -> (B, kv_heads, n, head_dim)."""
        B, n, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(B, n, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(keys, offset=offset), values

    def __call__(self, x: mx.array, context: ContextCache, mask: Optional[mx.array]) -> mx.array:
        B, L, _ = x.shape
        p = context.offset
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.heads, -1)).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=p)
        out = _attend(queries, *self.key_values(x, p), context, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Spark2_5Attention(nn.Module):
    def __init__(self, args: DraftArgs, layer_type: str):
        super().__init__()
        dim, self.heads, self.kv_heads, head_dim = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = head_dim**-0.5
        self.q_rows = self.heads * head_dim
        self.kv_rows = self.kv_heads * head_dim
        self.q_k_v_proj = nn.Linear(dim, self.q_rows + 2 * self.kv_rows, bias=args.attention_bias)
        self.g_proj = nn.Linear(dim, self.heads, bias=False)
        self.out_proj = nn.Linear(self.q_rows, dim, bias=args.attention_bias)
        theta, dims = args.rope[layer_type]
        self.rope = RoPE(dims, base=theta)

    def _split(self, qkv: mx.array, offset: int) -> tuple[mx.array, mx.array, mx.array]:
        B, n, _ = qkv.shape
        queries, keys, values = mx.split(qkv, [self.q_rows, self.q_rows + self.kv_rows], axis=-1)
        keys = self.rope(keys.reshape(B, n, self.kv_heads, -1).transpose(0, 2, 1, 3), offset=offset)
        values = values.reshape(B, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return queries, keys, values

    def key_values(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """Context rows use only the K and V parts of the fused projection."""
        _, keys, values = self._split(self.q_k_v_proj(x), offset)
        return keys, values

    def __call__(self, x: mx.array, context: ContextCache, mask: Optional[mx.array]) -> mx.array:
        B, L, _ = x.shape
        p = context.offset
        queries, keys, values = self._split(self.q_k_v_proj(x), p)
        queries = self.rope(queries.reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3), offset=p)
        out = _attend(queries, keys, values, context, self.scale, mask)  # (B, heads, L, head_dim)
        gate = mx.sigmoid(self.g_proj(x)).transpose(0, 2, 1)[..., None]  # (B, heads, L, 1)
        return self.out_proj((out * gate).transpose(0, 2, 1, 3).reshape(B, L, -1))


def _attend(queries, block_keys, block_values, context: ContextCache, scale: float, mask) -> mx.array:
    # Keys/values: the kept context (positions < p) followed by the block's own.
    cached = context.fetch()
    keys, values = block_keys, block_values
    if cached is not None:
        keys = mx.concatenate([cached[0].astype(keys.dtype), keys], axis=2)
        values = mx.concatenate([cached[1].astype(values.dtype), values], axis=2)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


class MLP(nn.Module):
    def __init__(self, args: DraftArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.act = nn.silu if args.family == "qwen3" else gelu

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: DraftArgs, layer: int):
        super().__init__()
        attention = Qwen3Attention if args.family == "qwen3" else Spark2_5Attention
        self.self_attn = attention(args, args.layer_types[layer])
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, h: mx.array, context: ContextCache, mask: Optional[mx.array]) -> mx.array:
        h = h + self.self_attn(self.input_layernorm(h), context, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DSparkDraft(nn.Module):
    def __init__(self, args: DraftArgs):
        super().__init__()
        self.args = args
        hidden = args.hidden_size
        self.fc = nn.Linear(len(args.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        markov = make_markov_head(
            head_type=args.markov_head_type, vocab_size=args.vocab_size, markov_rank=args.markov_rank, hidden_size=hidden
        )
        if markov is not None:
            self.markov_head = markov
        if args.enable_confidence_head:
            extra = args.markov_rank if args.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(hidden + extra, temperatures=args.confidence_temperatures)

    # -- loading ---------------------------------------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop the draft's frozen copies of the target's embedding and LM head (shared instead)."""
        return {k: v for k, v in weights.items() if not k.startswith(SHARED_PREFIXES)}

    def load_weights_strict(self, weights: dict[str, mx.array], *, source: str = "draft") -> None:
        """Strict tree update: ValueError listing missing / unexpected tensors and shape mismatches."""
        expected = dict(tree_flatten(self.parameters()))
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(set(weights) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{source}: draft tensors do not match the {self.args.family} DSpark layout; "
                f"missing {missing}, unexpected {unexpected}"
            )
        wrong = [f"{k}: {tuple(v.shape)} vs {tuple(expected[k].shape)}" for k, v in weights.items() if v.shape != expected[k].shape]
        if wrong:
            raise ValueError(f"{source}: draft tensor shapes differ from the config (file vs expected): {wrong}")
        self.update(tree_unflatten(list(weights.items())))

    # -- context ---------------------------------------------------------------------------------

    def make_cache(self) -> list[ContextCache]:
        return [ContextCache(window=self.args.layer_window(i)) for i in range(self.args.num_hidden_layers)]

    def append_context(self, features: mx.array, ctx: list[ContextCache]) -> None:
        """Cache context K/V for the next n committed positions from their target features (B, n, F)."""
        n = features.shape[1]
        if n == 0:
            return
        offset = ctx[0].offset
        # Rows each layer still needs: sliding layers drop all but their last `keep` positions.
        needed = [n if c.keep is None else min(n, c.keep) for c in ctx]
        rows = max(needed)
        # Features arrive in the target's dtype; compute and cache c(t) in the draft's.
        features = features[:, n - rows :].astype(self.hidden_norm.weight.dtype)
        fused = self.hidden_norm(self.fc(features))  # c(t), (B, rows, H)
        for layer, cache, need in zip(self.layers, ctx, needed):
            if need == 0:
                cache.advance(n)
                continue
            keys, values = layer.self_attn.key_values(fused[:, rows - need :], offset + n - need)
            cache.append(keys, values, num_positions=n)

    # -- block forward and drafting --------------------------------------------------------------

    def block_hidden(self, anchor: mx.array, ctx: list[ContextCache], *, target: Any) -> mx.array:
        """o = norm(h) of the block [anchor, mask x (block_size - 1)] at p .. p+block_size-1 -> (B, bs, H)."""
        B, size = anchor.shape[0], self.args.block_size
        ids = mx.concatenate(
            [anchor.reshape(B, 1), mx.full((B, size - 1), self.args.mask_token_id, dtype=anchor.dtype)], axis=1
        )
        h = target.embed(ids)
        masks: dict[tuple, Optional[mx.array]] = {}
        for layer, cache in zip(self.layers, ctx):
            key = (cache.window, cache.length)
            if key not in masks:
                masks[key] = block_mask(cache.offset, size, cache.length, cache.window)
            h = layer(h, cache, masks[key])
        return self.norm(h)

    def propose(
        self,
        anchor: mx.array,
        ctx: list[ContextCache],
        *,
        target: Any,
        greedy: bool = True,
        temperature: float = 1.0,
        num_tokens: Optional[int] = None,
    ) -> Proposal:
        """Draft `num_tokens` (default block_size) tokens after `anchor` (B,) at position p = context length.

        Lazy throughout: no host synchronization. Sampled drafting draws with the global MLX RNG.
        """
        size = self.args.block_size
        num_tokens = size if num_tokens is None else num_tokens
        if not 1 <= num_tokens <= size:
            raise ValueError(f"num_tokens must be in [1, {size}] (the draft's block_size), got {num_tokens}")
        if not greedy and temperature <= 0:
            raise ValueError(f"sampled drafting needs temperature > 0, got {temperature}; use greedy=True")
        hidden = self.block_hidden(anchor, ctx, target=target)[:, :num_tokens]  # o(1..K), (B, K, H)
        base = target.lm_head_logits(hidden).astype(mx.float32)  # z(1..K): one LM head matmul
        return draft_tokens(
            anchor,
            hidden,
            base,
            markov_head=getattr(self, "markov_head", None),
            confidence_head=getattr(self, "confidence_head", None),
            confidence_with_markov=self.args.confidence_head_with_markov,
            greedy=greedy,
            temperature=temperature,
        )
