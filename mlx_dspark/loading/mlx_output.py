"""What a conversion writes into an MLX directory: the files carried over, the destination checks,
the config with its dtype / quantization block. Shared by the safetensors and GGUF converters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from mlx_dspark.loading.checkpoint import INDEX_FILE

# Non-weight files carried over (tokenizer, generation defaults); never checkpoint code (*.py).
AUX_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    # a draft's: its vocabulary ranking (--draft-vocab), confidence calibration report, training record
    "vocab_rank.json",
    "calibration.json",
    "training.json",
)


def check_destination(src: Path, dst: Path, *, force: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"destination {dst} is a file; expected a directory")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"destination {dst} is the source directory; choose another --mlx-path")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise ValueError(f"destination {dst} is not empty; pass --force to overwrite it")


def clear_outputs(dst: Path) -> None:
    # --force: remove what an earlier conversion wrote, so stale shards never mix with new ones
    for path in list(dst.glob("*.safetensors")) + list(dst.glob(".shard-*.tmp.safetensors")) + [dst / INDEX_FILE, dst / "config.json"]:
        if path.is_file():
            path.unlink()


def write_config(
    config: dict, dst: Path, *, quantize: bool, q_bits: int, q_group_size: int, dtype: Optional[str], per_layer: Optional[dict] = None
) -> None:
    """config.json of a conversion; `per_layer`: module path -> its own {"group_size", "bits"} (as mlx-lm writes them)."""
    config = dict(config)
    if config.get("rope_is_neox_style") is False:
        config["rope_is_neox_style"] = True  # the draft's sanitize wrote q/k in rotate-half order
    if dtype is not None:
        config["dtype"] = dtype
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype
    if quantize:
        # the block MLX / mlx-lm write; the loader quantizes exactly the layers that carry scales
        config["quantization"] = {"group_size": q_group_size, "bits": q_bits, "mode": "affine", **(per_layer or {})}
        config["quantization_config"] = dict(config["quantization"])
    (dst / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
