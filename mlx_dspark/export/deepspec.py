"""Write a DSpark draft in DeepSpec's Hugging Face layout, as DeepSeek publishes its drafts
(`deepseek-ai/dspark_qwen3_4b_block7`) and as DeepSpec's loader, vLLM and SGLang read them.

- `config.json`: the draft's config (a copy of its target's) with the DSpark fields at the top level
  (`block_size`, `target_layer_ids`, `mask_token_id`, `markov_rank`, `markov_head_type`,
  `enable_confidence_head`, `confidence_head_with_markov`, `num_target_layers`, `layer_types`,
  `sliding_window`), `architectures: ["Qwen3DSparkModel"]` for Qwen3-style layers, `dtype` /
  `torch_dtype` of the weights, `tie_word_embeddings: false`; packaging fields (`dflash_config`,
  `quantization`) are folded in or dropped.
- `model.safetensors` (metadata `format: pt`): DeepSpec's tensor names (`fc`, `hidden_norm`,
  `layers.N.*`, `norm`, `markov_head.*`, `confidence_head.proj.*`) plus the frozen copies of the
  target's `embed_tokens.weight` and `lm_head.weight`, as DeepSpec saves them.

A draft with Spark2_5-style layers keeps our `Spark2_5DSparkModel` architecture: DeepSpec has no
class for it, so only our loader reads such a directory.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from mlx_dspark.export.hf_files import draft_fields, weights_dtype, write_checkpoint
from mlx_dspark.export.source import EMBED, HEAD, ExportDraft
from mlx_dspark.models.heads.dspark.args import DSPARK_FIELDS, NESTED_FIELDS

ARCHITECTURES = {"qwen3": "Qwen3DSparkModel", "spark2_5": "Spark2_5DSparkModel", "gemma4": "Gemma4DSparkModel"}
_DROPPED = ("quantization", "quantization_config", NESTED_FIELDS, "auto_map")


def deepspec_config(draft: ExportDraft, *, dtype: mx.Dtype) -> dict:
    """The config.json of the export (see the module docstring)."""
    args = draft.args
    config = {k: v for k, v in draft.config.items() if k not in _DROPPED}
    nested = draft.config.get(NESTED_FIELDS) or {}
    config.update({k: v for k, v in nested.items() if k in DSPARK_FIELDS})
    config.update(
        {
            "architectures": [ARCHITECTURES[args.family]],
            "block_size": args.block_size,
            "target_layer_ids": list(args.target_layer_ids),
            "mask_token_id": args.mask_token_id,
            "markov_rank": args.markov_rank,
            "markov_head_type": args.markov_head_type,
            "enable_confidence_head": args.enable_confidence_head,
            "confidence_head_with_markov": args.confidence_head_with_markov,
            **draft_fields(args, dtype=dtype),
        }
    )
    if not args.packaging.sample_from_anchor:  # a DFlash draft (z-lab's is so by its architecture, dropped here)
        config["sample_from_anchor"] = False
    if args.confidence_temperatures is not None:
        config["confidence_temperatures"] = list(args.confidence_temperatures)
    return dict(sorted(config.items()))


def check_exportable(draft: ExportDraft) -> None:
    """ValueError naming what the export lacks: the copies of the target's embedding and LM head."""
    missing = [name for name in (EMBED, HEAD) if name not in draft.shared]
    if missing:
        raise ValueError(
            f"{draft.path}: the draft holds no copy of the target's {' and '.join(missing)}, which DeepSpec's layout "
            "stores: pass --target with the draft's target so the export can include them"
        )


def write_deepspec(draft: ExportDraft, out: Path, *, dtype: mx.Dtype | None = None) -> list[str]:
    """Write the export into the directory `out` (created; the caller checked it may be written).

    `dtype` casts every floating tensor (default: the draft's own). Returns notes for the user."""
    check_exportable(draft)
    dtype = dtype or weights_dtype(draft.weights)
    weights = {**draft.weights, **{name: draft.shared[name] for name in (EMBED, HEAD)}}
    write_checkpoint(out, weights, deepspec_config(draft, dtype=dtype), dtype=dtype)
    notes = []
    if draft.args.family == "spark2_5":
        notes.append("the draft has Spark2_5-style layers: DeepSpec, vLLM and SGLang have no class for them (our loader reads it)")
    return notes
