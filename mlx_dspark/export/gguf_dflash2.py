"""The DFlash 2 part of a `dflash` draft GGUF (../shared/DRAFTERS.md section 1; llama.cpp
`src/models/dflash.cpp`): the keys `dflash.{conv_kernel_size, conv_group_size, selector_rank,
selector_top_k}` (plus `logit_scale` / `final_logit_softcapping` where they change the selector's logits)
and the tensors `blk.N.{attn,ffn}_conv_base`, `blk.N.{attn,ffn}_conv_proj.weight`,
`selector_{predecessor,successor,hidden}.weight`, named by the reader's own table (loading/gguf_dflash2.py)
turned around. No tensor is permuted: a (2, K, C) base is ggml {C, K, 2}, as upstream reads it.

Upstream's loader checks C % G == 0 (our loader refuses such a draft already: models/heads/dspark/dflash2_args.py) and
C >= top_k * (top_k + 1); a draft that fails the second is refused here by name rather than written into a
file llama.cpp would reject.
"""

from __future__ import annotations

from typing import Any

from mlx_dspark.export.source import ExportDraft
from mlx_dspark.loading import gguf_dflash2
from mlx_dspark.models.heads.dspark.dflash2_args import FIELDS


def check(draft: ExportDraft) -> None:
    """ValueError naming the llama.cpp check a DFlash 2 draft fails."""
    fields, hidden = draft.args.dflash2, draft.args.hidden_size
    need = fields.selector_top_k * (fields.selector_top_k + 1)
    if hidden < need:
        raise ValueError(
            f"{draft.path}: selector_top_k {fields.selector_top_k} needs hidden_size >= top_k * (top_k + 1) = {need} in "
            f"llama.cpp's DFlash 2 graph, the draft has {hidden}: export it --to zlab instead"
        )


def add_keys(writer: Any, draft: ExportDraft, *, prefix: str) -> None:
    fields = draft.args.dflash2
    for name in FIELDS:
        writer.add_uint32(prefix + name, getattr(fields, name))
    if fields.output_multiplier != 1.0:
        writer.add_float32(prefix + "logit_scale", fields.output_multiplier)
    if fields.final_logit_softcapping:
        writer.add_float32(prefix + "final_logit_softcapping", fields.final_logit_softcapping)


def tensor_names(num_layers: int) -> dict[str, str]:
    """Our name -> the GGUF name, for the convolutions and the selector (the reader's table reversed)."""
    return {ours: name for name, ours in gguf_dflash2.tensor_names(num_layers).items()}
