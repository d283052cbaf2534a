"""Tiny random mlx-lm models, built directly from `mlx_lm.models.<type>.ModelArgs` (no files), one per cache kind.

For rollback tests and benchmarks that run mlx-lm's own `__call__`: each covers one cache kind a target can
have (GatedDeltaNet `ArraysCache`, Mamba-2, LFM2 short-conv, `CacheList`, a wrapping `RotatingKVCache`,
`QuantizedKVCache`, MoE layers). Float32 random weights from `mx.random.seed(seed)`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import falcon_h1, gemma3_text, gemma4_text, lfm2, llama, mamba2, nemotron_h, qwen3_5, qwen3_next
from mlx_lm.models.cache import QuantizedKVCache

VOCAB = 97


def _qwen3_5(moe: bool = False, *, hidden: int = 64, layers: int = 4, vocab: int = VOCAB) -> Any:
    heads = max(2, hidden // 32)
    extra = {}
    if moe:
        extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
                     shared_expert_intermediate_size=hidden // 2, decoder_sparse_step=1)  # fmt: skip
    args = qwen3_5.TextModelArgs(
        model_type="qwen3_5_text", hidden_size=hidden, intermediate_size=2 * hidden if hidden < 256 else 3 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4) if hidden >= 256 else 2,
        vocab_size=vocab, linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2),
        linear_key_head_dim=hidden // heads, linear_value_head_dim=hidden // heads, head_dim=hidden // heads,
        full_attention_interval=4 if layers >= 4 and hidden >= 256 else 2, **extra,
    )  # fmt: skip
    return qwen3_5.TextModel(args)


def _qwen3_next() -> Any:
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        shared_expert_intermediate_size=32, mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6,
        vocab_size=VOCAB, num_key_value_heads=2, rope_theta=10000.0, partial_rotary_factor=0.25,
        max_position_embeddings=512, head_dim=16, full_attention_interval=2,
    )  # fmt: skip
    return qwen3_next.Model(args)


def _mamba2() -> Any:
    args = mamba2.ModelArgs(
        model_type="mamba2", num_heads=4, head_dim=16, vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
        state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1, use_bias=False,
        use_conv_bias=True, tie_word_embeddings=False, time_step_limit=(0.0, float("inf")), time_step_rank=8,
    )  # fmt: skip
    return mamba2.Model(args)


def _lfm2() -> Any:
    args = lfm2.ModelArgs(
        model_type="lfm2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
        block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
        block_ff_dim=128, layer_types=["conv", "full_attention", "conv", "conv"],
    )  # fmt: skip
    return lfm2.Model(args)


def _nemotron_h() -> Any:
    args = nemotron_h.ModelArgs(
        model_type="nemotron_h", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        max_position_embeddings=512, num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
        mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4,
        n_groups=2, mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
        hybrid_override_pattern=list("M*-MEM"), head_dim=16, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, n_group=1, n_routed_experts=4, n_shared_experts=1,
        topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=1.0,
    )  # fmt: skip
    return nemotron_h.Model(args)


def _falcon_h1() -> Any:
    args = falcon_h1.ModelArgs(
        hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4,
        num_hidden_layers=3, vocab_size=VOCAB,
    )  # fmt: skip
    return falcon_h1.Model(args)


def _gemma3_sliding() -> Any:
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=2,
        head_dim=16, num_key_value_heads=1, vocab_size=VOCAB, sliding_window=5, sliding_window_pattern=2,
        query_pre_attn_scalar=16,
    )  # fmt: skip
    return gemma3_text.Model(args)


def _gemma4() -> Any:
    sliding, full = "sliding_attention", "full_attention"
    args = gemma4_text.ModelArgs(
        hidden_size=64, num_hidden_layers=5, intermediate_size=128, num_attention_heads=2, head_dim=16,
        global_head_dim=32, num_key_value_heads=1, num_kv_shared_layers=2, vocab_size=VOCAB,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, sliding_window=5,
        layer_types=[sliding, full, sliding, sliding, full], enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32,
    )  # fmt: skip
    return gemma4_text.Model(args)


def _llama() -> Any:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=2,
        num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=VOCAB, head_dim=64, tie_word_embeddings=False,
    )  # fmt: skip
    return llama.Model(args)


FACTORIES = {
    "qwen3_5": _qwen3_5,  # GatedDeltaNet ArraysCache + KVCache
    "qwen3_5_moe": lambda: _qwen3_5(moe=True),  # the same with MoE MLPs
    "qwen3_next": _qwen3_next,  # GatedDeltaNet + attention, every MLP a MoE
    "mamba2": _mamba2,  # Mamba-2 ArraysCache only: no offsets at all
    "lfm2": _lfm2,  # short-conv ArraysCache + KVCache
    "nemotron_h": _nemotron_h,  # Mamba-2 ArraysCache + KVCache, MLP and MoE blocks without caches
    "falcon_h1": _falcon_h1,  # CacheList(ArraysCache, KVCache) per layer
    "gemma3_text": _gemma3_sliding,  # RotatingKVCache (window 5) + KVCache
    "gemma4_text": _gemma4,  # the same, KV-shared layers (fewer caches than layers), per-layer inputs, MoE
    "llama_quantized": _llama,  # QuantizedKVCache (make_cache below)
}


def _spread(model: Any, scale: float = 2.0) -> None:
    """Weight matrices drawn from normal(0, scale / sqrt(fan_in)) (conv kernels kept): mlx-lm's default
    initialization makes some tiny models (lfm2) repeat one token, which would hide a wrong cache."""
    weights = [
        (name, mx.random.normal(w.shape) * scale / w.shape[-1] ** 0.5 if w.ndim >= 2 and "conv" not in name else w)
        for name, w in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(weights))


def tiny_mlx_lm_model(kind: str, *, seed: int = 0) -> Any:
    """A tiny float32 mlx-lm model of `kind` (a key of FACTORIES) with random weights."""
    mx.random.seed(seed)
    model = FACTORIES[kind]()
    _spread(model)
    mx.eval(model.parameters())
    return model


def scaled_qwen3_5(*, hidden: int, layers: int, vocab: int, seed: int = 0) -> Any:
    """A qwen3_5 hybrid (3 GatedDeltaNet layers per full-attention layer) of a given size, random float32 weights."""
    mx.random.seed(seed)
    model = _qwen3_5(hidden=hidden, layers=layers, vocab=vocab)
    mx.eval(model.parameters())
    return model


def make_mlx_lm_cache(kind: str, model: Any) -> list[Any]:
    """The model's own caches; `llama_quantized` gets mlx-lm's 8-bit QuantizedKVCache (as `--kv-bits 8`)."""
    if kind == "llama_quantized":
        return [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]
    return model.make_cache()
