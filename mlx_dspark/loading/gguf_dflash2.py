"""DFlash 2 drafts in llama.cpp's `dflash` GGUF (../shared/DRAFTERS.md section 1; llama.cpp
`src/models/dflash.cpp`, `common/speculative.cpp`).

A DFlash 2 file has the architecture name of a DFlash / DSpark draft; the selector tells it apart
(`selector_hidden.weight` present, or `dflash.selector_top_k` > 0, as upstream decides). Its keys
`dflash.{conv_kernel_size, conv_group_size, selector_rank, selector_top_k}` become the config's DFlash 2
fields (models/heads/dspark/dflash2_args.py), `dflash.logit_scale` / `dflash.final_logit_softcapping` its
`output_multiplier` / `final_logit_softcapping` (read by the selector only); the tensors take z-lab's
Hugging Face names (models/heads/dspark/dflash2.py). The conv bases are ggml {C, K, 2}: (2, K, C) as read, z-lab's
`base_kernel` layout; no tensor is permuted.
"""

from __future__ import annotations

from typing import Any

from mlx_dspark.loading.gguf_metadata import Metadata
from mlx_dspark.models.heads.dspark.dflash2_args import FIELDS

LAYER_TENSORS = {
    "attn_conv_base": "attention_conv.base_kernel",
    "attn_conv_proj.weight": "attention_conv.kernel_projection.weight",
    "ffn_conv_base": "mlp_conv.base_kernel",
    "ffn_conv_proj.weight": "mlp_conv.kernel_projection.weight",
}
SELECTOR_TENSORS = {
    "selector_predecessor.weight": "candidate_selector.predecessor_codebook",  # z-lab: no `.weight`
    "selector_successor.weight": "candidate_selector.successor_codebook",
    "selector_hidden.weight": "candidate_selector.hidden_projection.weight",
}


def is_dflash2_draft(meta: Metadata, p: str) -> bool:
    top_k = meta.get(p + "selector_top_k")
    return "selector_hidden.weight" in meta.tensors or (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0)


def fields(meta: Metadata, p: str) -> dict[str, Any]:
    """The DFlash 2 config fields of the file's keys (each required; a missing one is named)."""
    out: dict[str, Any] = {k: meta.integer(p + k, low=1) for k in FIELDS}
    scale, cap = meta.number(p + "logit_scale", None), meta.number(p + "final_logit_softcapping", None)
    if scale is not None:
        out["output_multiplier"] = scale
    if cap:
        out["final_logit_softcapping"] = cap
    return out


def tensor_names(num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> our name, for the convolutions and the selector."""
    names = dict(SELECTOR_TENSORS)
    for i in range(num_layers):
        names.update({f"blk.{i}.{g}": f"layers.{i}.{h}" for g, h in LAYER_TENSORS.items()})
    return names
