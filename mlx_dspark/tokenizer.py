"""The target's tokenizer (mlx-lm's `TokenizerWrapper`) with the eos ids of its config files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_dspark.checkpoint import read_json

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def eos_token_ids(path: Path, config: dict) -> list[int]:
    """eos ids of config.json and generation_config.json (either may be an int or a list)."""
    ids: list[int] = []
    sources = [config]
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        sources.append(read_json(gen_path))
    for src in sources:
        value = src.get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def load_tokenizer(path: Path, config: dict):
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{path}: no tokenizer files (expected one of {list(TOKENIZER_FILES)}); the target directory must carry its tokenizer"
        )
    # A Spark config names custom code (auto_map): we never run it. trust_remote_code=False keeps
    # transformers from stopping to ask; a blank model config keeps it from reading config.json at all.
    extra: dict[str, Any] = {"trust_remote_code": False}
    if "auto_map" in config:
        from transformers import PretrainedConfig

        extra["config"] = PretrainedConfig()
    return mlx_lm_load_tokenizer(path, extra, eos_token_ids=eos_token_ids(path, config) or None)
