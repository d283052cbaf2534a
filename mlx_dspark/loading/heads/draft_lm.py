"""A small causal LM as the draft (`load(target, draft=<dir or repo>)`, `--draft` / mlx-lm's `--draft-model`):
any model mlx-lm runs, told apart by its config being a causal LM's with none of the other heads' keys
(`GENERIC`: tried after the heads that have keys of their own). Built into models/heads/draft_lm.DraftLM over
mlx-lm's own model class, its weights through the family's sanitize, stored quantization read as stored.

A plain language model's GGUF (`llama`, `qwen2`, `qwen3`; llama.cpp's `-md small.gguf`) is read into the same
form by loading/gguf_lm.py, its tokenizer from its `tokenizer.ggml.*` keys.

The draft must share the target's vocabulary: its tokenizer is read and compared with the target's token by
token (ids both have map to the same token; ids only one has lie past the other's table, as a padded
embedding does); a mismatch is one line naming both files. Options that shape a DSpark draft are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.loading.checkpoint import Checkpoint, is_gguf
from mlx_dspark.loading.heads import refuse_block_options
from mlx_dspark.loading.precision import quant_predicate
from mlx_dspark.loading.tokenizer import TOKENIZER_FILES, load_tokenizer
from mlx_dspark.loading.weights import fill_model
from mlx_dspark.models.heads.draft_lm import DraftLM
from mlx_dspark.models.target.mlx_lm import mlx_lm_classes

# a config names a causal LM by its architecture (a multimodal wrapper of one, as Qwen3.5's, drafts its text)
CAUSAL_ARCHITECTURES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")

DESCRIPTION = "a draft model (a causal LM of the target's vocabulary)"
HELP = "a draft model: any causal LM mlx-lm runs with the target's tokenizer (mlx-lm's --draft-model, e.g. Qwen/Qwen3-0.6B for a Qwen3 target)"  # --draft's help
GENERIC = True  # any causal LM config: tried after the heads with keys of their own; a target's config is no draft


def detect(config: dict) -> bool:
    """A config mlx-lm builds a model for, whose `architectures` (when given) name a causal LM."""
    architectures = config.get("architectures") or []
    if architectures and not any(str(a).endswith(CAUSAL_ARCHITECTURES) for a in architectures):
        return False
    try:
        mlx_lm_classes(config)
    except ValueError:
        return False
    return True


def _tokenizer_file(directory: Path) -> Path:
    return next((directory / f for f in TOKENIZER_FILES if (directory / f).is_file()), directory)


def check_vocabulary(draft_vocab: dict[str, int], target_vocab: dict[str, int], *, draft_file: Path, target_file: Path) -> None:
    """ValueError naming both files unless the two tokenizers give every token they share the same id."""
    ours, theirs = {i: t for t, i in draft_vocab.items()}, {i: t for t, i in target_vocab.items()}
    size_ours, size_theirs = max(ours, default=-1) + 1, max(theirs, default=-1) + 1
    for i in sorted(set(ours) | set(theirs)):
        a, b = ours.get(i), theirs.get(i)
        if a == b or (a is None and i >= size_ours) or (b is None and i >= size_theirs):
            continue
        raise ValueError(
            f"{draft_file}: the draft model's tokenizer differs from the target's ({target_file}): token id {i} is "
            f"{a!r} in the draft, {b!r} in the target; a draft model must share the target's vocabulary"
        )


def build(checkpoint: Checkpoint, *, target: nn.Module, target_source: str, dtype: Optional[mx.Dtype],
          options: dict[str, Any]) -> DraftLM:  # fmt: skip
    """The draft model (lazy weights), its tokenizer checked against the target's (`options["target_tokenizer"]`)."""
    config, config_source, path = checkpoint.config, checkpoint.config_source, Path(checkpoint.path)
    refuse_block_options(options, source=config_source, this="a draft model (a causal LM reading tokens, over the whole vocabulary)")
    target_tokenizer = options.get("target_tokenizer")
    if target_tokenizer is not None:
        draft_file, target_file = _tokenizer_file(path), _tokenizer_file(Path(target_source).parent)
        if draft_file == path and not is_gguf(path):  # a GGUF's tokenizer is its tokenizer.ggml.* keys (or files beside it)
            raise ValueError(f"{path}: no tokenizer files (expected one of {list(TOKENIZER_FILES)}) beside the draft model: "
                             f"its vocabulary cannot be checked against the target's ({target_file}); add them")  # fmt: skip
        draft_tokenizer = load_tokenizer(path, config, gguf_tokenizer=checkpoint.tokenizer)
        check_vocabulary(draft_tokenizer.get_vocab(), target_tokenizer.get_vocab(), draft_file=draft_file, target_file=target_file)
    model_class, args_class = mlx_lm_classes(config, source=config_source)
    try:
        args = args_class.from_dict(config)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{config_source}: {e}") from None
    model = fill_model(model_class(args), config, dict(checkpoint.weights), checkpoint.origin, source=str(path),
                       what="draft model", dtype=checkpoint.default_dtype if dtype is None else dtype,
                       config_name=Path(config_source).name)  # fmt: skip
    model.eval()
    draft = DraftLM(model, vocab_size=target.args.vocab_size, model_type=config["model_type"])
    try:
        draft.make_cache()
    except ValueError as e:  # a cache kind with no exact rollback
        raise ValueError(f"{config_source}: the draft model's caches cannot roll back: {e}") from None
    return draft


def quantize(module: DraftLM, *, bits: int, group_size: int) -> None:
    """The layers mlx-lm would quantize, at the given width (layers stored quantized stay as stored)."""
    nn.quantize(module.model, group_size, bits, class_predicate=quant_predicate(module.model, group_size=group_size))
