"""Write an EAGLE-3 draft in vLLM speculators' layout (`speculators_model_type: eagle3`; ../shared/DRAFTERS.md
section 3), the layout vLLM reads EAGLE-3 drafts from and our loader (loading/heads/eagle3.py) reads.

- `config.json`: the draft's own speculators config (`transformer_layer_config`, `draft_vocab_size`,
  `target_hidden_size`, `norm_before_residual`, `norm_before_fc`, `embed_requires_grad`,
  `eagle_aux_hidden_state_layer_ids`, `speculators_config`, ...), with `torch_dtype` / `dtype` of the
  weights and quantization fields dropped.
- `model.safetensors` (metadata `format: pt`): speculators' names (`fc`, `layers.0.*` where SpecForge
  wrote `midlayer.*`, `norm`, `lm_head`, `input_norm` with `norm_before_fc`), and for a reduced vocabulary
  `d2t` (int64 offsets: target id = i + d2t[i]) and `t2d` (bool over the target vocabulary), as speculators'
  `DraftVocabMixin` saves them; the frozen copy of the target's `embed_tokens.weight` when it is known
  (the source's own, or the target's with --target), the draft's own table with `embed_requires_grad`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx

from mlx_dspark.export.hf_files import dtype_name, weights_dtype, write_checkpoint
from mlx_dspark.export.source import EMBED, ExportDraft
from mlx_dspark.models.heads.d2t import CHECKPOINT_NAME, DROPPED, PARAMETER_NAME

_INVERSE = DROPPED[0]  # "t2d"


def speculators_weights(draft: ExportDraft) -> dict[str, mx.array]:
    """The draft's tensors under speculators' names: its absolute ids back to `d2t` offsets, with `t2d`."""
    weights = {k: v for k, v in draft.weights.items() if k != PARAMETER_NAME}
    ids = draft.weights.get(PARAMETER_NAME)
    if ids is not None:
        ids = ids.astype(mx.int64)
        weights[CHECKPOINT_NAME] = ids - mx.arange(ids.size, dtype=mx.int64)
        t2d = mx.zeros((draft.args.vocab_size,), dtype=mx.bool_)
        t2d[ids] = True
        weights[_INVERSE] = t2d
    if EMBED in draft.shared:
        weights[EMBED] = draft.shared[EMBED]
    return weights


def write_speculators(draft: ExportDraft, out: Path, *, dtype: Optional[mx.Dtype] = None) -> list[str]:
    """Write the export into the directory `out`; `dtype` casts every floating tensor (default: the
    draft's own). Returns notes for the user."""
    dtype = dtype or weights_dtype(draft.weights)
    name = dtype_name(dtype)
    config = {**draft.config, "torch_dtype": name, "dtype": name}
    write_checkpoint(out, speculators_weights(draft), dict(sorted(config.items())), dtype=dtype)
    if draft.args.own_embedding or EMBED in draft.shared:
        return []
    return ["the files hold no copy of the target's embedding (the source had none): pass --target to include it"]
