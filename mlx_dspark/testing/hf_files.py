"""Tiny checkpoints' Hugging Face files: a target directory's tokenizer and configs, safetensors written
(one file or shards with their index) and read back. The writers in testing/ draw the weights; these put
them in the layout the loaders read."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from mlx_dspark.testing.tiny_tokenizer import _write_json, write_tokenizer

_DTYPES = ("float32", "bfloat16", "float16")


def write_target_dir(path: str | Path, config_of: Callable[[dict[str, Any]], dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """A tiny target's directory: the qwen3 test tokenizer, `config.json` (`config_of(its token ids)`) and
    `generation_config.json`; returns (path, config), the caller writes the weights (`save_hf_weights`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(path, family="qwen3")
    config = config_of(ids)
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", {"bos_token_id": ids["bos"], "eos_token_id": ids["gen_eos"], "pad_token_id": ids["pad"]})
    return path, config


def save_hf_weights(path: Path, weights: dict[str, np.ndarray], *, dtype: str = "float32", num_shards: int = 1) -> None:
    """Write weights as Hugging Face safetensors (`model.safetensors`, or `num_shards` shards plus
    `model.safetensors.index.json`), floating ones cast to `dtype` (bf16 goes through MLX: numpy has no bf16),
    integer ones (fp8 bytes, token tables) as they are."""
    import mlx.core as mx

    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {_DTYPES}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    mx_dtype = getattr(mx, dtype)
    arrays = {k: mx.array(v).astype(mx_dtype) if np.issubdtype(v.dtype, np.floating) else mx.array(v) for k, v in weights.items()}
    names = list(arrays)
    if num_shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), arrays, metadata={"format": "pt"})
        return
    chunks = [list(c) for c in np.array_split(np.array(names, dtype=object), num_shards)]
    weight_map = {}
    for i, chunk in enumerate(chunks):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        mx.save_safetensors(str(path / shard), {k: arrays[k] for k in chunk}, metadata={"format": "pt"})
        weight_map.update({k: shard for k in chunk})
    total = sum(a.nbytes for a in arrays.values())
    _write_json(path / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _read_hf_weights(path: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    files = sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        for k, v in mx.load(str(f)).items():
            out[k] = np.array(v.astype(mx.float32))
    return out
