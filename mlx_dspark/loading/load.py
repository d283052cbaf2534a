"""Loading a target (and optionally its DSpark draft): `load()`, and building either model from a
`Checkpoint` (config dict + lazy weights), whatever file format it was read from.

`load(target, draft=None, *, dtype=None, quantize=None, q_group_size=64, draft_tap_ids=None)` returns
a `LoadedModel`. Either path may be a checkpoint directory, a Hugging Face repo id, a `.gguf` file, a
directory holding one GGUF, or one GGUF file of a repo (`owner/name:FILE.gguf`); `read_checkpoint`
turns each into the same `Checkpoint`, so everything below is format-blind. Weights are checked
strictly against the model built from the config (`weights.py`); the pair is validated and the draft's
frozen copies of the target's embedding / LM head are compared with the target's and dropped (`pair.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.loading.checkpoint import Checkpoint, read_checkpoint, resolve_path
from mlx_dspark.models.finite import check_finite_weights
from mlx_dspark.models import target_module
from mlx_dspark.models.dspark import SHARED_PREFIXES, DSparkDraft
from mlx_dspark.models.dspark_args import DraftArgs, canonical_names, is_draft_config, layer_family
from mlx_dspark.loading.pair import check_shared_tensors, validate_pair
from mlx_dspark.loading.precision import check_quantize_options, parse_dtype, quant_predicate
from mlx_dspark.loading.tokenizer import load_tokenizer
from mlx_dspark.loading.weights import fill_model


@dataclass
class LoadedModel:
    target: nn.Module
    draft: Optional[nn.Module]
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    target_config: dict
    draft_config: Optional[dict]
    target_path: Path
    draft_path: Optional[Path]


def build_target(checkpoint: Checkpoint, *, dtype: Optional[mx.Dtype] = None) -> nn.Module:
    """The target model of a checkpoint, its (lazy) weights in place; dtype None: the checkpoint's
    `default_dtype` (a GGUF's compute dtype), else the weights as stored."""
    config, source = checkpoint.config, checkpoint.config_source
    if is_draft_config(config):
        raise ValueError(f"{source}: this is a DSpark draft (it has target_layer_ids); pass it as draft=, with its target")
    module = target_module(config, source=source)
    model = module.Model(module.ModelArgs.from_dict(config, source=source))
    return fill_model(
        model, config, dict(checkpoint.weights), checkpoint.origin,
        source=str(checkpoint.path), what="target", dtype=checkpoint.default_dtype if dtype is None else dtype, config_name=Path(source).name,
    )  # fmt: skip


def build_draft(
    checkpoint: Checkpoint,
    *,
    target: Optional[nn.Module] = None,
    target_source: str = "target",
    dtype: Optional[mx.Dtype] = None,
    tap_ids: Optional[Sequence[int]] = None,
) -> tuple[DSparkDraft, dict[str, mx.array]]:
    """(draft, its copies of the target's embedding / LM head as stored, possibly none).

    With `target`, the pair is validated before any weight is checked; `tap_ids` replaces the config's
    `target_layer_ids` (then validated against the target under the name `draft_tap_ids`)."""
    config, config_source, source = checkpoint.config, checkpoint.config_source, str(checkpoint.path)
    if not is_draft_config(config):
        raise ValueError(
            f"{config_source}: not a DSpark draft: no target_layer_ids (top level or under dflash_config); "
            "pass a draft checkpoint as draft="
        )
    # Read once: DeepSpec tensor names from any packaging, the layer family from them, then the args.
    weights, origin = canonical_names(checkpoint.weights, checkpoint.origin, source=source)
    family = layer_family(list(weights), source=source)
    args = DraftArgs.from_dict(config, family=family, source=config_source, tap_ids=None if tap_ids is None else list(tap_ids))
    taps_field = "target_layer_ids" if tap_ids is None else "draft_tap_ids"
    if target is not None:
        validate_pair(target.args, args, target_source=target_source, draft_source=config_source, taps_field=taps_field)
    fc = weights.get("fc.weight")
    if fc is not None and "fc.scales" not in weights and fc.shape[-1] != len(args.target_layer_ids) * args.hidden_size:
        raise ValueError(
            f"{source}: {taps_field} {list(args.target_layer_ids)} gives {len(args.target_layer_ids)} tapped layers but "
            f"fc.weight takes {fc.shape[-1] / args.hidden_size:g} x hidden_size features"
        )
    shared = {k: v for k, v in weights.items() if k.startswith(SHARED_PREFIXES)}
    model = fill_model(
        DSparkDraft(args), config, weights, origin,
        source=source, what="draft", dtype=checkpoint.default_dtype if dtype is None else dtype, config_name=Path(config_source).name,
    )  # fmt: skip
    return model, shared


def load(
    target: str | Path,
    draft: str | Path | None = None,
    *,
    dtype: str | mx.Dtype | None = None,
    quantize: Optional[int] = None,
    q_group_size: int = 64,
    draft_tap_ids: Optional[Sequence[int]] = None,
    tool_parser: Optional[str] = None,
) -> LoadedModel:
    """Load a target and optionally its DSpark draft.

    target / draft: a checkpoint directory (Hugging Face or MLX layout), a Hugging Face repo id, a
      `.gguf` file (llama.cpp: a spark2_5 / qwen3 target, a `dflash` / `dspark` draft), a directory
      holding one GGUF, or `owner/name:FILE.gguf` (downloads only that file). A GGUF target's tokenizer
      is the tokenizer.json (+ tokenizer_config.json) beside the file when there is one, else the one
      its `tokenizer.ggml.*` keys describe; its eos ids come from the GGUF.
    dtype: cast floating weights ("bfloat16", "float16", "float32"). None: as stored, except that a
      GGUF computes in its matrices' dtype (its F32 norms cast to it) and a quantized GGUF in bfloat16
      (its float16 scales rounded; see `checkpoint.gguf_compute_dtype`).
    quantize: 4 or 8 bits at load time, the layers mlx-lm would quantize (input dim a multiple of
      `q_group_size`; norms and the family's source-precision layers, e.g. spark2_5's `g_proj`, stay
      in float).
    draft_tap_ids: the target layers the draft reads, as Hugging Face layer ids (the output of layer
      i; -1 is the embedding), replacing the draft's `target_layer_ids` or its GGUF `target_layers`.
      A GGUF's `target_layers` is read as upstream llama.cpp's current converters write it, HF id + 1;
      a file from an older converter that wrote the HF ids unchanged needs this override, e.g.
      `draft_tap_ids=[2, 10, 18, 25, 33]` for the Spark-X2.6-4B draft (the ids its model card lists).
    tool_parser: an mlx-lm tool parser (a module of `mlx_lm.tool_parsers`, e.g. "json_tools") replacing
      the one mlx-lm infers from the chat template.
    """
    mx_dtype = parse_dtype(dtype)
    if quantize is not None:
        check_quantize_options(bits=quantize, group_size=q_group_size)
    if draft_tap_ids is not None and draft is None:
        raise ValueError("draft_tap_ids only applies with a draft; pass draft= as well")
    target_path = resolve_path(target, role="target")
    target_checkpoint = read_checkpoint(target_path, role="target")
    target_model = build_target(target_checkpoint, dtype=mx_dtype)
    check_finite_weights(target_model, what=f"target ({target_path})")
    if quantize is not None and "quantization" in target_checkpoint.config:
        raise ValueError(
            f"{target_checkpoint.config_source}: the checkpoint is already quantized "
            f"({target_checkpoint.config['quantization']}); load it without quantize="
        )
    tokenizer = load_tokenizer(target_path, target_checkpoint.config, gguf_tokenizer=target_checkpoint.tokenizer,
                               tool_parser=tool_parser)

    draft_model = draft_config = draft_path = None
    if draft is not None:
        draft_path = resolve_path(draft, role="draft")
        draft_checkpoint = read_checkpoint(draft_path, role="draft", tap_ids=draft_tap_ids)
        draft_config = draft_checkpoint.config
        draft_model, shared = build_draft(
            draft_checkpoint, target=target_model, target_source=target_checkpoint.config_source,
            dtype=mx_dtype, tap_ids=draft_tap_ids,
        )  # fmt: skip
        check_finite_weights(draft_model, what=f"draft ({draft_path})")  # before the shared copies are compared
        check_shared_tensors(shared, target_model, draft_source=str(draft_path), storage=draft_checkpoint.storage)
    target_config = target_checkpoint.config
    del target_checkpoint  # the raw (uncast, unsanitized) weights are no longer needed

    for model in (target_model, draft_model):
        if model is None:
            continue
        if quantize is not None:
            nn.quantize(model, q_group_size, quantize, class_predicate=quant_predicate(model, group_size=q_group_size))
        model.eval()
        mx.eval(model.parameters())
    return LoadedModel(
        target=target_model,
        draft=draft_model,
        tokenizer=tokenizer,
        target_config=target_config,
        draft_config=draft_config,
        target_path=target_path,
        draft_path=draft_path,
    )
