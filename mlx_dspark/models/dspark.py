"""The DSpark draft (DSPARK.md section 3): context fusion, one block forward, Markov and confidence heads.

The draft attends from a block `[anchor, mask x (block_size - 1)]` at positions `p .. p+block_size-1`
to the fused target features of the committed positions (`c(t) = hidden_norm(fc(f(t)))`, projected
to K/V once per position and cached) and to the block itself, without a causal mask. Output row `k-1`
of the block predicts the token at `p + k`. Its layers are built from the pieces of its layer family's
module (`models/qwen3.py` or `models/spark2_5.py`: attention, MLP, norms, config reading); the family
comes from the draft's tensors (`models/dspark_args.py`), not from its target.
The draft never owns the embedding or the LM head: it calls `target.embed` / `target.lm_head_logits`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.models.draft_cache import ContextCache
from mlx_dspark.models import family_module
from mlx_dspark.models.dspark_args import DraftArgs
from mlx_dspark.models.dspark_heads import ConfidenceHead, Proposal, draft_tokens, make_markov_head

__all__ = ["SHARED_PREFIXES", "DSparkDraft", "DraftArgs", "DecoderLayer", "block_mask"]

# Frozen copies of the target's tensors that DeepSpec saves in the draft; the draft shares the target's.
SHARED_PREFIXES = ("embed_tokens.", "embedding.", "lm_head.")


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


class DecoderLayer(nn.Module):
    """A pre-norm block of the family's own pieces; only the attention's inputs are the draft's."""

    def __init__(self, args: DraftArgs, layer: int):
        super().__init__()
        family = family_module(args.family)
        layer_args = args.layers
        self.self_attn = family.Attention(layer_args, layer_args.layer_types[layer])
        self.mlp = family.MLP(layer_args)
        self.input_layernorm = family.Norm(layer_args.hidden_size, eps=layer_args.rms_norm_eps)
        self.post_attention_layernorm = family.Norm(layer_args.hidden_size, eps=layer_args.rms_norm_eps)

    def __call__(self, h: mx.array, context: ContextCache, mask: Optional[mx.array]) -> mx.array:
        # Queries and the block's own K/V from the block rows; the cached context K/V come first.
        attn = self.self_attn.attend(self.input_layernorm(h), offset=context.offset, context=context.fetch(), mask=mask)
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class DSparkDraft(nn.Module):
    def __init__(self, args: DraftArgs):
        super().__init__()
        self.args = args
        hidden = args.hidden_size
        self.fc = nn.Linear(len(args.target_layer_ids) * hidden, hidden, bias=False)
        eps = args.layers.rms_norm_eps
        self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(hidden, eps=eps)
        markov = make_markov_head(
            head_type=args.markov_head_type, vocab_size=args.vocab_size, markov_rank=args.markov_rank, hidden_size=hidden
        )
        if markov is not None:
            self.markov_head = markov
        if args.enable_confidence_head:
            extra = args.markov_rank if args.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(hidden + extra, temperatures=args.confidence_temperatures)

    # -- loading ---------------------------------------------------------------------------------

    def quant_predicate(self, path: str, module: nn.Module) -> bool:
        """The layer family's choice of what stays in source precision when quantizing (as its target's)."""
        keep = family_module(self.args.family).Model.keep_in_source_precision
        return not (keep and path.endswith(keep))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop the draft's frozen copies of the target's embedding and LM head (shared instead)."""
        return {k: v for k, v in weights.items() if not k.startswith(SHARED_PREFIXES)}

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
        logits_hook: Optional[Callable] = None,
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
            logits_hook=logits_hook,
        )
