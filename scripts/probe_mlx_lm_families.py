"""Issue 25: which of mlx-lm's model types our target adapter (models/target/mlx_lm.py) takes, by its
load-time probe, on random weights from one generic small config.

    python scripts/probe_mlx_lm_families.py

Every `mlx_lm.models.<model_type>` whose ModelArgs can be built from the generic config below is built
with random weights and probed (`probe_target`): PASS (our forward reproduces mlx-lm's own logits),
REFUSED (with the reason; "mlx-lm's own forward fails" means the generic config does not suit that
family, not a verdict on it), or not surveyed (its ModelArgs needs fields the generic config lacks).
A PASS here says the adapter takes the family apart exactly; it is not a test of that family's
checkpoints, caches or rollback. Each PASS is then checked for continuous batching
(`models/packed/mlx_lm.target_packing_problem`: recurrent layers refused by name, then a short packed forward
against its rows' own forwards): PACKS, or the reason it does not.
"""

from __future__ import annotations

import pkgutil
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_dspark.models.target.mlx_lm import from_config, probe_target  # noqa: E402
from mlx_dspark.models.packed.mlx_lm import target_packing_problem as packing_problem  # noqa: E402

GENERIC = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
    tie_word_embeddings=False, layer_norm_eps=1e-5, norm_eps=1e-5, attention_bias=False, mlp_bias=False,
    hidden_act="silu", rope_traditional=False, rope_scaling=None, sliding_window=64, partial_rotary_factor=1.0,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, query_pre_attn_scalar=16, sliding_window_pattern=2,
    n_shared_experts=1, n_routed_experts=4, first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=16,
    q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, topk_method="greedy",
    scoring_func="softmax", routed_scaling_factor=1.0, topk_group=1, n_group=1,
)  # fmt: skip
# Fields a few families need beyond the generic config (their own names for scales and state sizes).
EXTRA = {
    "minicpm": dict(dim_model_base=32, scale_depth=1.4, scale_emb=12.0),
    "granite": dict(logits_scaling=8.0, attention_multiplier=0.015625, embedding_multiplier=12.0, residual_multiplier=0.22),
    "qwen3_next": dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, full_attention_interval=2, partial_rotary_factor=0.25),
    "mamba2": dict(num_heads=4, state_size=16, conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True,
                   layer_norm_epsilon=1e-5, time_step_limit=(0.0, float("inf")), time_step_rank="auto", expand=2),
    "gpt_neox": dict(rotary_emb_base=10000, rotary_pct=0.25),
    "gemma3": dict(text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, vocab_size=128, sliding_window=64,
                                    sliding_window_pattern=2, query_pre_attn_scalar=16), vocab_size=128),
}  # fmt: skip
NOT_MODELS = {"base", "cache", "rope_utils", "switch_layers", "activations", "pipeline", "gated_delta", "ssm", "bitlinear_layers"}


def main() -> None:
    import mlx_lm.models

    passed, refused, skipped, unpacked = [], {}, [], {}
    for name in sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)):
        if name in NOT_MODELS:
            continue
        try:
            mx.random.seed(0)
            model = from_config(dict(GENERIC, model_type=name, **EXTRA.get(name, {})), source=name)
            mx.eval(model.parameters())
        except (Exception, SystemExit):  # generic config unfit, or an import that exits (olmo): not surveyed
            skipped.append(name)
            continue
        try:
            probe_target(model)
            passed.append(name)
        except ValueError as e:
            refused[name] = str(e)
            continue
        unpacked[name] = packing_problem(model)
    print(f"PASS ({len(passed)}): {', '.join(passed)}")
    packs = [n for n, why in unpacked.items() if why is None]
    print(f"PACKS ({len(packs)} of {len(passed)}): {', '.join(packs)}")
    for name, why in unpacked.items():
        if why is not None:
            print(f"DOES NOT PACK {name}: {why[:240]}")
    for name, why in refused.items():
        print(f"REFUSED {name}: {why[:240]}")
    print(f"not surveyed ({len(skipped)}): {', '.join(skipped)}")


if __name__ == "__main__":
    main()
