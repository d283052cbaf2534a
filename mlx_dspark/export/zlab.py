"""Write a DFlash 2 draft in z-lab's Hugging Face layout (z-lab/dflash `DFlash2DraftModel`;
../shared/DRAFTERS.md section 1), the layout DFlash 2 drafts are published in and our loader reads.
DeepSpec's layout has no DFlash 2 (no convolutions, no selector), so this is the Hugging Face target.

- `config.json`: the draft's Qwen3 layer config (`model_type: qwen3`) with `architectures:
  ["DFlash2DraftModel"]`, `is_causal: false`, `block_size` (at the top level, as z-lab's DFlash
  configs have it, and under `dflash_config`), and `dflash_config` holding `mask_token_id`,
  `target_layer_ids`, `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`, and
  `output_multiplier` / `final_logit_softcapping` / `input_embedding_scale` where they are not the identity;
  the DSpark head fields (Markov, confidence) and packaging fields are dropped (a DFlash 2 draft has neither
  head; its block is [anchor, mask ...] by its architecture).
- `model.safetensors` (metadata `format: pt`): the backbone under DeepSpec / z-lab names (`fc`,
  `hidden_norm`, `layers.N.*`, `norm`), per layer `attention_conv` / `mlp_conv` (`base_kernel`,
  `kernel_projection.weight`), `candidate_selector.{predecessor,successor}_codebook` (no `.weight`) and
  `candidate_selector.hidden_projection.weight`; no copy of the target's embedding or LM head (z-lab's
  drafts use the target's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx

from mlx_dspark.export.hf_files import draft_fields, weights_dtype, write_checkpoint
from mlx_dspark.export.source import ExportDraft
from mlx_dspark.models.heads.dspark.dflash2_args import ARCHITECTURE, FIELDS
from mlx_dspark.models.heads.dspark.args import DSPARK_FIELDS, NESTED_FIELDS

_DROPPED = ("quantization", "quantization_config", "auto_map", "sample_from_anchor", "use_cache", *DSPARK_FIELDS, *FIELDS)


def zlab_config(draft: ExportDraft, *, dtype: mx.Dtype) -> dict:
    """The config.json of the export (see the module docstring)."""
    args, fields = draft.args, draft.args.dflash2
    nested = {
        "block_size": args.block_size,
        "mask_token_id": args.mask_token_id,
        "target_layer_ids": list(args.target_layer_ids),
        **{name: getattr(fields, name) for name in FIELDS},
    }
    if fields.output_multiplier != 1.0:
        nested["output_multiplier"] = fields.output_multiplier
    if fields.final_logit_softcapping:
        nested["final_logit_softcapping"] = fields.final_logit_softcapping
    if args.packaging.embedding_scale is not None:
        nested["input_embedding_scale"] = args.packaging.embedding_scale
    config = {k: v for k, v in draft.config.items() if k not in _DROPPED and k != NESTED_FIELDS}
    config.update(
        {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "is_causal": False,
            "block_size": args.block_size,
            NESTED_FIELDS: dict(sorted(nested.items())),
            **draft_fields(args, dtype=dtype),
        }
    )
    return dict(sorted(config.items()))


def check_exportable(draft: ExportDraft) -> None:
    """ValueError naming what z-lab's DFlash2DraftModel cannot hold."""
    args = draft.args
    if args.family != "qwen3":
        raise ValueError(
            f"{draft.path}: the DFlash 2 draft has {args.family}-style layers; z-lab's DFlash2DraftModel has Qwen3 layers "
            "(export it --to gguf: our loader reads that file)"
        )
    ropes = set(args.layers.rope_by_type[t] for t in args.layer_types)
    if len(ropes) > 1 or any(dims != args.layers.head_dim for _, dims in ropes):
        raise ValueError(
            f"{draft.path}: the draft's RoPE turns part of each head or differs per layer type, which z-lab's layout "
            "cannot hold (its Qwen3RotaryEmbedding turns the whole head, one theta): export it --to gguf"
        )
    packaging = args.packaging
    if packaging.value_scale is not None or packaging.attention_scale is not None:
        raise ValueError(
            f"{draft.path}: the draft scales its attention (attention_value_scale / attention_scale), which z-lab's "
            "layout has no field for: export it --to gguf"
        )


def write_zlab(draft: ExportDraft, out: Path, *, dtype: Optional[mx.Dtype] = None) -> list[str]:
    """Write the export into the directory `out`; `dtype` casts every floating tensor (default: the
    draft's own). Returns notes for the user."""
    check_exportable(draft)
    dtype = dtype or weights_dtype(draft.weights)
    write_checkpoint(out, draft.weights, zlab_config(draft, dtype=dtype), dtype=dtype)
    return ["the target's embedding and LM head are not in the files: z-lab's DFlash 2 drafts use the target's"]
