"""mlx-lm's own spark2_5 model with the reference's float32 residual stream (the one change).

Why not mlx-lm's class as it is: the Spark reference (DSPARK.md section 2) keeps the residual stream and
the norms in float32 and runs the projections in the weights' dtype; mlx-lm's `spark2_5` keeps the
residual in the weights' dtype. In float32 the two are bitwise equal; in bfloat16 they differ. Measured
on ../shared/fixtures/spark-tiny against the float64 NumPy restatement (tests/spark_reference.py, bf16-
rounded weights, 3 prompts of 40 tokens; /tmp/prof/bf16_ref.py): mean |logit error| 0.24-0.26 with the
float32 residual, 0.30-0.33 with mlx-lm's (max 1.9-2.3 against 2.1-2.8, on logits of scale ~40).

Everything else is mlx-lm's: parameters and checkpoint names, `sanitize`, `quant_predicate`, the
attention (its masks, caches, quantized-cache attention), the head.
"""

from __future__ import annotations

from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import spark2_5
from mlx_lm.models.base import create_attention_mask


def _norm(norm: nn.RMSNorm, x: mx.array, dtype: mx.Dtype) -> mx.array:
    # float32 in, float32 weight: the reference's norm, handed to the next projection in `dtype`
    return mx.fast.rms_norm(x, norm.weight.astype(mx.float32), norm.eps).astype(dtype)


class TransformerBlock(spark2_5.TransformerBlock):
    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None, *, dtype: mx.Dtype = mx.float32) -> mx.array:
        # x: the float32 residual stream; the sublayers run in the compute dtype
        h = x + self.self_attn(_norm(self.input_layernorm, x, dtype), mask, cache).astype(mx.float32)
        return h + self.mlp(_norm(self.post_attention_layernorm, h, dtype)).astype(mx.float32)


class Spark2_5Model(spark2_5.Spark2_5Model):
    def __init__(self, args: spark2_5.ModelArgs):
        super().__init__(args)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None, input_embeddings: Optional[mx.array] = None) -> mx.array:
        x = input_embeddings if input_embeddings is not None else self.embedding(inputs)
        dtype = x.dtype  # the compute dtype: the (possibly quantized) embedding's
        if cache is None:
            cache = [None] * len(self.layers)
        full_mask = None if self._first_full is None else create_attention_mask(x, cache[self._first_full])
        sliding_mask = None
        if self._first_sliding is not None:
            sliding_mask = create_attention_mask(x, cache[self._first_sliding], window_size=self.args.sliding_window)
        h = x.astype(mx.float32)
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, sliding_mask if layer.is_sliding else full_mask, layer_cache, dtype=dtype)
        return _norm(self.norm, h, dtype)


class Model(spark2_5.Model):
    def __init__(self, args: spark2_5.ModelArgs):
        super().__init__(args)
        self.model = Spark2_5Model(args)

    @property
    def feature_dtype(self) -> mx.Dtype:
        """The compute dtype (the embedding's): the reference hands the draft its taps in it."""
        embedding = self.model.embedding
        return getattr(embedding, "scales", embedding.weight).dtype

    @staticmethod
    def check_config(config: dict, *, source: str) -> None:
        """What mlx-lm's spark2_5 would run silently as plain RoPE: refused, naming the field."""
        if config.get("rope_scaling"):
            raise ValueError(f"{source}: rope_scaling {config['rope_scaling']!r} is not supported; only default RoPE")
        for layer_type, params in (config.get("rope_parameters") or {}).items():
            kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
            if kind != "default":
                raise ValueError(f"{source}: rope_parameters.{layer_type} has rope_type {kind!r}; only 'default' RoPE is supported")
