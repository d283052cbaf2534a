"""A tiny random DFlash 2 draft in z-lab's Hugging Face layout (../shared/DRAFTERS.md section 1):
`architectures: ["DFlash2DraftModel"]`, the DFlash 2 fields under `dflash_config`, per layer
`attention_conv` / `mlp_conv` (`base_kernel` [2, K, C], `kernel_projection.weight` [2 K C/G, C]) and
`candidate_selector.{predecessor,successor}_codebook` [V, rank] (no `.weight`) with
`candidate_selector.hidden_projection.weight` [rank, C]; the backbone is a z-lab DFlash draft's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mlx_dspark.testing.draft_layouts import repackage
from mlx_dspark.testing.tiny import _read_hf_weights, _write_json, save_hf_weights


def write_dflash2_draft(
    deepspec_draft: str | Path, dst: str | Path, *, seed: int = 0, kernel_size: int = 2, group_size: int = 16,
    rank: int = 8, top_k: int = 4, output_multiplier: float | None = None, softcap: float | None = None,
    dtype: str = "float32",
) -> Path:  # fmt: skip
    """The DeepSpec-layout draft's backbone as a z-lab DFlash draft, plus random DFlash 2 convolutions and selector,
    stored in `dtype`."""
    dst = repackage(deepspec_draft, Path(dst), "zlab_dflash")
    config = json.loads((dst / "config.json").read_text(encoding="utf-8"))
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"].update(conv_kernel_size=kernel_size, conv_group_size=group_size, selector_rank=rank, selector_top_k=top_k)
    if output_multiplier is not None:
        config["dflash_config"]["output_multiplier"] = output_multiplier
    if softcap is not None:
        config["dflash_config"]["final_logit_softcapping"] = softcap
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    rng = np.random.default_rng(seed)
    weights = _read_hf_weights(dst)
    for i in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            # a centred tap 0 near 1 (the identity) and small others, so the block stays a useful draft
            base = 0.1 * rng.standard_normal((2, kernel_size, hidden))
            base[:, 0] += 1.0
            weights[f"layers.{i}.{conv}.base_kernel"] = base.astype(np.float32)
            weights[f"layers.{i}.{conv}.kernel_projection.weight"] = (
                0.05 * rng.standard_normal((2 * kernel_size * hidden // group_size, hidden))
            ).astype(np.float32)
    weights["candidate_selector.predecessor_codebook"] = rng.standard_normal((vocab, rank)).astype(np.float32)
    weights["candidate_selector.successor_codebook"] = rng.standard_normal((vocab, rank)).astype(np.float32)
    weights["candidate_selector.hidden_projection.weight"] = (rng.standard_normal((rank, hidden)) / np.sqrt(hidden)).astype(np.float32)
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    save_hf_weights(dst, dict(sorted(weights.items())), dtype=dtype)
    _write_json(dst / "config.json", config)
    return dst
