"""The DSpark draft (DSPARK.md section 3): context fusion, one block forward, Markov and confidence heads.

The draft attends from a block `[anchor, mask x (block_size - 1)]` at positions `p .. p+block_size-1`
to the fused target features of the committed positions (`c(t) = hidden_norm(fc(f(t)))`, projected
to K/V once per position and cached) and to the block itself, without a causal mask. Output row `k-1`
of the block predicts the token at `p + k`. Its layers are built from the pieces of its layer family's
module (`models/layers/qwen3.py` or `models/layers/spark2_5.py`: attention, MLP, norms, config reading); the family
comes from the draft's tensors (`models/heads/dspark/args.py`), not from its target.
The draft shares the target's embedding and LM head (`target.embed` / `target.lm_head_logits`),
except where its packaging (`models/heads/dspark/packaging.py`) says otherwise: a few embedding rows of its
own (`set_embedding_rows`, e.g. a trained mask row), or a reduced vocabulary with its own LM head.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_dspark.models.caches.draft_context import ContextCache
from mlx_dspark.models import family_module
from mlx_dspark.models.heads.dspark.args import DraftArgs
from mlx_dspark.models.heads.draft_vocab import DraftVocabulary
from mlx_dspark.models.heads.dspark.markov import ConfidenceHead, draft_tokens, make_markov_head
from mlx_dspark.models.heads.proposal import Proposal
from mlx_dspark.models.heads.dspark.tree import TreeChildren
from mlx_dspark.models.heads import d2t

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
        if args.packaging.attention_scale is not None:
            self.self_attn.scale = args.packaging.attention_scale
        self._value_scale = args.packaging.value_scale
        self.mlp = family.MLP(layer_args)
        hidden, eps = layer_args.hidden_size, layer_args.rms_norm_eps
        self.input_layernorm = family.Norm(hidden, eps=eps)
        self.post_attention_layernorm = family.Norm(hidden, eps=eps)
        self._sandwich = getattr(family, "SANDWICH_NORMS", False)
        if self._sandwich:  # Gemma: norms after attention and MLP too, the output times a scalar
            self.pre_feedforward_layernorm = family.Norm(hidden, eps=eps)
            self.post_feedforward_layernorm = family.Norm(hidden, eps=eps)
            self.layer_scalar = mx.ones((1,))

    def __call__(self, h: mx.array, context: ContextCache, mask: Optional[mx.array]) -> mx.array:
        # Queries and the block's own K/V from the block rows; the cached context K/V come first.
        return self.forward(h, lambda x: self.self_attn.attend(x, offset=context.offset, context=context.fetch(), mask=mask))

    def forward(self, h: mx.array, attend: Callable[[mx.array], mx.array]) -> mx.array:
        """The layer over block rows h (B, L, H) with `attend(x)` its attention's output for inputs x (B, L, H)
        (the context's; models/packed/forward.py passes one that splits the rows per sequence)."""
        return self.residual(h, attend(self.input_layernorm(h)))

    def residual(self, h: mx.array, attn: mx.array) -> mx.array:
        """The block after its attention output `attn` (also models/packed/forward.py's): the family's residual form."""
        if self._value_scale is not None:  # after the output projection, as upstream's graph scales it
            attn = attn * self._value_scale
        if self._sandwich:
            h = h + self.post_attention_layernorm(attn)
            h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
            return h * self.layer_scalar
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class DSparkDraft(nn.Module):
    # A reduced vocabulary to draft from (models/heads/draft_vocab.py), set by the loader; None: the full one.
    # A plain attribute, not a parameter: its arrays are rows of the target's LM head and of markov_w2.
    vocabulary: Optional[DraftVocabulary] = None
    whole_head_reason: Optional[str] = None  # why the draft must read the target's whole LM head (no reduced vocabulary)

    def __init__(self, args: DraftArgs):
        super().__init__()
        self.args = args
        hidden = args.hidden_size
        self.fc = nn.Linear(len(args.target_layer_ids) * hidden, hidden, bias=False)
        eps = args.layers.rms_norm_eps
        self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(hidden, eps=eps)
        packaging = args.packaging
        markov = make_markov_head(
            head_type=args.markov_head_type, vocab_size=args.vocab_size, markov_rank=args.markov_rank, hidden_size=hidden,
            output_size=packaging.draft_vocab_size, bias_scale=packaging.markov_w2_scale,
        )  # fmt: skip
        if markov is not None:
            self.markov_head = markov
        if args.enable_confidence_head:
            extra = args.markov_rank if args.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(hidden + extra, temperatures=args.confidence_temperatures)
        if packaging.draft_vocab_size is not None:
            # a reduced vocabulary: the draft's own LM head over its rows, and their target ids
            self.lm_head = nn.Linear(hidden, packaging.draft_vocab_size, bias=False)
            setattr(self, d2t.PARAMETER_NAME, mx.zeros((packaging.draft_vocab_size,), dtype=mx.int32))
        self._embedding_rows: Optional[tuple[list[int], mx.array]] = None  # (ids, rows (n, H)): see set_embedding_rows

    @property
    def num_drafts(self) -> int:
        """The most draft tokens one proposal holds."""
        return self.args.num_drafts

    def set_embedding_rows(self, ids: list[int], rows: mx.array) -> None:
        """Rows of the draft's own embedding that differ from the target's (a draft trained with its own
        mask embedding): the block's input uses them instead of the target's."""
        self._embedding_rows = ([int(i) for i in ids], rows)

    # -- loading ---------------------------------------------------------------------------------

    def quant_predicate(self, path: str, module: nn.Module) -> bool:
        """The layer family's choice of what stays in source precision when quantizing (as its target's)."""
        keep = getattr(family_module(self.args.family), "KEEP_IN_SOURCE_PRECISION", ())
        return not (keep and path.endswith(keep))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop the draft's frozen copies of the target's embedding and LM head (shared instead; a
        reduced-vocabulary draft keeps its own head), `d2t` offsets to target ids, and interleaved
        RoPE weights to rotate-half order."""
        packaging = self.args.packaging
        own_head = packaging.draft_vocab_size is not None
        out = {}
        for k, v in weights.items():
            if k in d2t.DROPPED or (k.startswith(SHARED_PREFIXES) and not (own_head and k.startswith("lm_head."))):
                continue
            if k == d2t.CHECKPOINT_NAME:
                if not own_head:
                    raise ValueError("the draft has a 'd2t' tensor (a reduced vocabulary) but its config sets no draft_vocab_size")
                ids = d2t.absolute_ids(
                    np.array(v), vocab_size=self.args.vocab_size, draft_vocab_size=packaging.draft_vocab_size, source="the draft"
                )
                k, v = d2t.PARAMETER_NAME, mx.array(ids)
            elif not self.args.rope_is_neox_style and k.endswith(_INTERLEAVED_ROPE):
                v = _rotate_half_order(v, self.args.layers.head_dim)
            out[k] = v
        if own_head and d2t.PARAMETER_NAME not in out:
            raise ValueError(f"draft_vocab_size is {packaging.draft_vocab_size} but the draft has no 'd2t' tensor mapping its rows to target ids")
        return out

    # -- context ---------------------------------------------------------------------------------

    def make_cache(self) -> list[ContextCache]:
        return [ContextCache(window=self.args.layer_window(i)) for i in range(self.args.num_hidden_layers)]

    def context_rows(self, ctx: list[ContextCache]) -> int | None:
        """The most recent positions whose features an append still needs (None: all, a full-attention layer)."""
        keeps = [c.keep for c in ctx]
        return None if any(k is None for k in keeps) else max(keeps)

    def append_context(self, features: mx.array, ctx: list[ContextCache], *, num_positions: int | None = None) -> None:
        """Cache context K/V for the next n committed positions from their target features (B, rows, F):
        the features of all n positions, or (`num_positions` = n) of the last ones only, as many as the
        layers keep (`context_rows`)."""
        n = features.shape[1] if num_positions is None else num_positions
        if n == 0:
            return
        offset = ctx[0].offset
        # Rows each layer still needs: sliding layers drop all but their last `keep` positions.
        needed = [n if c.keep is None else min(n, c.keep) for c in ctx]
        rows = max(needed)
        if features.shape[1] < rows:
            raise ValueError(f"append_context: {n} positions need the features of the last {rows}, got {features.shape[1]}")
        features = features[:, features.shape[1] - n :] if features.shape[1] > n else features
        n_rows = features.shape[1]
        # Features arrive in the target's dtype; compute and cache c(t) in the draft's.
        features = features[:, n_rows - rows :].astype(self.hidden_norm.weight.dtype)
        fused = self.hidden_norm(self.fc(features))  # c(t), (B, rows, H)
        for layer, cache, need in zip(self.layers, ctx, needed):
            if need == 0:
                cache.advance(n)
                continue
            keys, values = layer.self_attn.key_values(fused[:, rows - need :], offset + n - need)
            cache.append(keys, values, num_positions=n)

    # -- block forward and drafting --------------------------------------------------------------

    def embed_block(self, ids: mx.array, *, target: Any) -> mx.array:
        """The block's input rows (..., H): the target's embedding, the draft's own rows, the family's
        and the packaging's scales (Gemma: sqrt(hidden), in the table's dtype)."""
        h = target.embed(ids)
        if self._embedding_rows is not None:
            for row_id, row in zip(*self._embedding_rows):
                h = mx.where((ids == row_id)[..., None], row.astype(h.dtype), h)
        family_scale = getattr(self.args.layers, "embedding_scale", None)
        if family_scale is not None:
            h = h * mx.array(family_scale, dtype=h.dtype)
        if self.args.packaging.embedding_scale is not None:
            h = h * self.args.packaging.embedding_scale
        return h

    def cap_logits(self, base: mx.array) -> mx.array:
        """Base logits as the family computes them: Gemma soft-caps them before the Markov bias
        (DeepSpec's `compute_logits`); unchanged otherwise."""
        cap = getattr(self.args.layers, "final_logit_softcapping", None)
        return base if cap is None else mx.tanh(base / cap) * cap

    def block_hidden(self, anchor: mx.array, ctx: list[ContextCache], *, target: Any) -> mx.array:
        """o = norm(h) of the block [anchor, mask x (block_size - 1)] at p .. p+block_size-1 -> (B, bs, H)."""
        B, size = anchor.shape[0], self.args.block_size
        ids = mx.concatenate(
            [anchor.reshape(B, 1), mx.full((B, size - 1), self.args.mask_token_id, dtype=anchor.dtype)], axis=1
        )
        h = self.embed_block(ids, target=target)
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
        """Draft `num_tokens` (default `num_drafts`) tokens after `anchor` (B,) at position p = context length.

        Lazy throughout: no host synchronization. Sampled drafting draws with the global MLX RNG.
        """
        size = self.num_drafts
        num_tokens = size if num_tokens is None else num_tokens
        if not 1 <= num_tokens <= size:
            raise ValueError(f"num_tokens must be in [1, {size}] (the draft tokens of one block), got {num_tokens}")
        if not greedy and temperature <= 0:
            raise ValueError(f"sampled drafting needs temperature > 0, got {temperature}; use greedy=True")
        block = self.block_hidden(anchor, ctx, target=target)
        return self.propose_from_block(
            anchor, block, target=target, greedy=greedy, temperature=temperature, num_tokens=num_tokens, logits_hook=logits_hook
        )

    def propose_from_block(
        self,
        anchor: mx.array,
        block: mx.array,
        *,
        target: Any,
        greedy: bool,
        temperature: float,
        num_tokens: int,
        logits_hook: Optional[Callable] = None,
    ) -> Proposal:
        """The heads of `propose` over a block forward's output `block` (B, block_size, H) (models/packed/forward.py
        computes it for several sequences at once)."""
        hidden, base = self.block_logits(block, target=target, num_tokens=num_tokens)
        return draft_tokens(
            anchor,
            hidden,
            base,
            markov_head=getattr(self, "markov_head", None),
            confidence_head=getattr(self, "confidence_head", None),
            confidence_with_markov=self.args.confidence_head_with_markov,
            greedy=greedy,
            temperature=temperature,
            draft_to_target=getattr(self, d2t.PARAMETER_NAME, None),
            vocab_size=self.args.vocab_size,
            vocabulary=self.vocabulary,
            logits_hook=logits_hook,
        )

    def block_logits(self, block: mx.array, *, target: Any, num_tokens: int) -> tuple[mx.array, mx.array]:
        """(o(1..K) (B, K, H), the base logits z(1..K) (B, K, V') float32, capped) of a block forward's output;
        V' is the draft's rows (a `d2t` head or a reduced vocabulary's), else the target's vocabulary."""
        first = self.args.packaging.first_draft_row
        hidden = block[:, first : first + num_tokens]  # o(1..K), (B, K, H)
        if getattr(self, d2t.PARAMETER_NAME, None) is not None:
            base = self.lm_head(hidden).astype(mx.float32)  # z(1..K) over the draft's own rows (d2t)
        elif self.vocabulary is not None:
            base = self.vocabulary.logits(hidden).astype(mx.float32)  # over the reduced vocabulary's rows (FR-Spec)
        else:
            base = target.lm_head_logits(hidden).astype(mx.float32)  # one LM head matmul
        return hidden, self.cap_logits(base)

    @property
    def grows_trees(self) -> bool:
        """Whether `tree_children` gives this draft's own distributions (a subclass with its own heads, DFlash 2's
        candidate selector, does not)."""
        return type(self).propose_from_block is DSparkDraft.propose_from_block

    def tree_children(self, anchor: mx.array, ctx: list[ContextCache], *, target: Any, depth: int) -> TreeChildren:
        """The draft's distributions for a token tree after `anchor` (1,) (engine/tree/grow.py grows it): one block
        forward, then the Markov head's conditional logits per parent token (dspark_tree.py)."""
        if not self.grows_trees:
            raise ValueError(f"{type(self).__name__} drafts through its own heads: token trees grow from DSpark's "
                             "Markov-head or marginal distributions only; use tree_nodes 0")  # fmt: skip
        if not 1 <= depth <= self.num_drafts:
            raise ValueError(f"depth must be in [1, {self.num_drafts}] (the draft tokens of one block), got {depth}")
        hidden, base = self.block_logits(self.block_hidden(anchor, ctx, target=target), target=target, num_tokens=depth)
        draft_ids = getattr(self, d2t.PARAMETER_NAME, None)
        vocabulary = self.vocabulary
        return TreeChildren(
            hidden[0], base[0], markov_head=getattr(self, "markov_head", None), vocab_size=self.args.vocab_size,
            row_ids=draft_ids if draft_ids is not None else (None if vocabulary is None else vocabulary.ids),
            markov_out=None if vocabulary is None else vocabulary.markov_bias,
        )  # fmt: skip


# q/k projections and norms a `rope_is_neox_style: false` checkpoint stores in interleaved order
_INTERLEAVED_ROPE = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def _rotate_half_order(weight: mx.array, head_dim: int) -> mx.array:
    """Per head, the even dims then the odd ones: interleaved RoPE pairs (2i, 2i+1) become the
    rotate-half pairs (i, i + head_dim/2), as upstream's converter permutes such checkpoints."""
    shape = weight.shape
    return weight.reshape(-1, head_dim // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
