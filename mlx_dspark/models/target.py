"""The target contract both families share (ARCHITECTURE.md, "Target model contract").

A family module supplies its `ModelArgs`, its `DecoderLayer` and `Norm`, and the checkpoint name of
its input embedding; `TargetModel` owns the rest: the backbone (`model.*`), the caches, the embedding
and LM head calls, the tapped forward loop and the checkpoint renames every family needs.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.models.cache import kv_group_size, make_target_cache
from mlx_dspark.models.base import check_tap_ids, gather_taps


class Backbone(nn.Module):
    """`model.*`: the input embedding (under the family's checkpoint name), the layers, the final norm."""

    def __init__(self, args: Any, *, embed_name: str, layer: type, norm: type):
        super().__init__()
        setattr(self, embed_name, nn.Embedding(args.vocab_size, args.hidden_size))
        self.layers = [layer(args, layer_type) for layer_type in args.layer_types]
        self.norm = norm(args.hidden_size, eps=args.rms_norm_eps)


class TargetModel(nn.Module):
    embed_name: str  # attribute of `self.model` holding the input embedding (its checkpoint name)
    decoder_layer: type  # the family's DecoderLayer(args, layer_type)
    norm_class: type  # the family's RMSNorm
    # Layer paths (suffixes) that keep their source precision when quantizing, as mlx-lm's own model
    # of the family does, so a target converted by either tool is the same file.
    keep_in_source_precision: tuple[str, ...] = ()

    def __init__(self, args: Any):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Backbone(args, embed_name=self.embed_name, layer=self.decoder_layer, norm=self.norm_class)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    @property
    def layer_types(self) -> list[str]:
        return self.args.effective_layer_types()

    @property
    def embedding(self) -> nn.Module:
        return getattr(self.model, self.embed_name)

    # Bits of the full-attention layers' KV caches (load(kv_bits=) sets it); None: float caches.
    kv_bits: Optional[int] = None

    def make_cache(self, *, max_rollback: int = 8) -> list[Any]:
        group = 64 if self.kv_bits is None else kv_group_size(self.args.head_dim)
        return make_target_cache(
            self.layer_types, window=self.args.window, max_rollback=max_rollback, kv_bits=self.kv_bits, kv_group_size=group
        )

    def embed(self, ids: mx.array) -> mx.array:
        return self.embedding(ids)

    def lm_head_logits(self, h: mx.array) -> mx.array:
        """Logits from final-normed hidden states; works for tied, untied and quantized heads."""
        if self.args.tie_word_embeddings:
            return self.embedding.as_linear(h)
        return self.lm_head(h)

    # The two places a family's numerics differ: the residual stream's dtype and what a layer and the
    # final norm are told about the compute dtype (the embedding's).
    def residual(self, x: mx.array) -> mx.array:
        return x

    def run_layer(self, layer: nn.Module, h: mx.array, cache: Optional[Any], dtype: mx.Dtype) -> mx.array:
        return layer(h, cache)

    def final_norm(self, h: mx.array, dtype: mx.Dtype) -> mx.array:
        return self.model.norm(h)

    def __call__(
        self,
        inputs: mx.array,
        cache: Optional[list[Any]] = None,
        *,
        tap_ids: tuple[int, ...] = (),
        last_only: bool = False,
    ) -> tuple[mx.array, Optional[mx.array]]:
        tap_ids = check_tap_ids(tap_ids, self.args.num_hidden_layers)
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} caches (one per layer), got {len(cache)}")
        x = self.embed(inputs)  # (B, L, hidden)
        dtype = x.dtype  # compute dtype: the (possibly quantized) embedding's
        h = self.residual(x)
        taps = {-1: h}
        for i, layer in enumerate(self.layers):
            h = self.run_layer(layer, h, None if cache is None else cache[i], dtype)
            if i in tap_ids:
                taps[i] = h
        features = gather_taps(taps, tap_ids, dtype)
        if last_only:
            h = h[:, -1:]
        return self.lm_head_logits(self.final_norm(h, dtype)), features

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop serialized RoPE buffers and a tied model's `lm_head` (the only renames every family needs)."""
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def quant_predicate(self, path: str, module: nn.Module) -> bool:
        """Whether the family quantizes this layer (the group-size fit is checked by the caller)."""
        return not (self.keep_in_source_precision and path.endswith(self.keep_in_source_precision))
