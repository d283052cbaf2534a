"""The target's tokenizer (mlx-lm's `TokenizerWrapper`) with the eos ids of its config files.

For a GGUF target: the tokenizer files beside the GGUF when there are any (a file converted from a
model whose pre-tokenizer the GGUF metadata cannot describe needs them), else the Hugging Face files
its `tokenizer.ggml.*` keys describe (`gguf_tokenizer.GGUFTokenizer.directory()`); eos ids from the GGUF.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_dspark.loading.checkpoint import is_gguf, read_json

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


def _has_tokenizer_files(directory: Path) -> bool:
    return any((directory / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_directory(path: Path, *, gguf_tokenizer: Any = None) -> Path:
    """The directory holding the target's Hugging Face tokenizer files (see the module docstring).

    gguf_tokenizer: the GGUF's `GGUFTokenizer` (None when the file has no tokenizer keys)."""
    if not is_gguf(path):
        if not _has_tokenizer_files(path):
            raise FileNotFoundError(
                f"{path}: no tokenizer files (expected one of {list(TOKENIZER_FILES)}); the target directory must carry its tokenizer"
            )
        return path
    if _has_tokenizer_files(path.parent):
        return path.parent
    if gguf_tokenizer is None:
        raise FileNotFoundError(
            f"{path}: no tokenizer: the GGUF has no tokenizer.ggml.* keys and there is no tokenizer.json beside it; "
            "put the model's tokenizer.json and tokenizer_config.json beside the GGUF file"
        )
    return gguf_tokenizer.directory()  # ValueError naming the fix when the metadata describes no supported tokenizer


def check_tool_parser(name: str) -> str:
    """An mlx-lm tool parser's name (a module of mlx_lm.tool_parsers); ValueError listing them."""
    import pkgutil

    import mlx_lm.tool_parsers

    names = sorted(m.name for m in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__))
    if name not in names:
        raise ValueError(f"unknown tool parser {name!r}; mlx-lm has {', '.join(names)}")
    return name


def load_tokenizer(path: Path, config: dict, *, gguf_tokenizer: Any = None, tool_parser: str | None = None):
    """The tokenizer of the target at `path` (a checkpoint directory or a GGUF file); `tool_parser`
    names mlx-lm's tool parser instead of the one it infers from the chat template."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    directory = tokenizer_directory(path, gguf_tokenizer=gguf_tokenizer)
    eos: list[int] = list(gguf_tokenizer.eos_token_ids) if gguf_tokenizer is not None else []
    eos += [i for i in eos_token_ids(directory, config) if i not in eos]
    # A Spark config names custom code (auto_map): we never run it. trust_remote_code=False keeps
    # transformers from stopping to ask; a blank model config keeps it from reading config.json at all
    # (beside a GGUF there may be none; a config converted from a GGUF names a family transformers lacks).
    extra: dict[str, Any] = {"trust_remote_code": False}
    if tool_parser is not None:
        extra["tool_parser_type"] = check_tool_parser(tool_parser)  # mlx-lm reads it from the tokenizer config
    if "auto_map" in config or is_gguf(path) or not _transformers_knows(config.get("model_type")):
        from transformers import PretrainedConfig

        extra["config"] = PretrainedConfig()
    return mlx_lm_load_tokenizer(directory, extra, eos_token_ids=eos or None)


def _transformers_knows(model_type: Any) -> bool:
    from transformers import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING
