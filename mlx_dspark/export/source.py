"""A draft to export, read from any checkpoint we load (DeepSpec / Spark safetensors, our MLX layout,
MLX-quantized, GGUF): its config and its float weights under DeepSpec's names.

The draft is built exactly as `mlx_dspark.load` builds it (the same config parsing, the same strict
tensor checks; with a target, the pair checks too), then its parameters are read back: what the
exporters write is what our loader would compute with. MLX-quantized layers are dequantized (their
affine groups expanded to the scales' dtype) and the export says so: the exported file holds the
dequantized values, not the original float weights the quantization came from.

The draft's frozen copies of the target's embedding and LM head are kept apart (`shared`): from the
draft's own file when it has float copies, else from the target (DeepSpec's layout stores them; a
GGUF draft leaves them out and uses the target's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_dspark.loading.checkpoint import read_checkpoint, resolve_path
from mlx_dspark.loading.load import build_draft, build_target
from mlx_dspark.models.dspark_args import DraftArgs
from mlx_dspark.models.heads import target_head

EMBED, HEAD = "embed_tokens.weight", "lm_head.weight"


@dataclass
class ExportDraft:
    path: Path  # where it was read from
    config: dict[str, Any]  # as read (config.json layout; a GGUF's rebuilt), without quantization fields
    args: DraftArgs
    weights: dict[str, mx.array]  # DeepSpec names, float, without the shared copies
    shared: dict[str, mx.array] = field(default_factory=dict)  # EMBED / HEAD when known
    gguf_tokenizer: Any = None  # the tokenizer material of a GGUF source (`GGUFTokenizer`), if any
    notes: list[str] = field(default_factory=list)  # what the user should know about the export


def float_parameters(model: nn.Module) -> tuple[dict[str, mx.array], list[str]]:
    """(the model's parameters with every quantized layer dequantized, the dequantized layers' names)."""
    params = dict(tree_flatten(model.parameters()))
    dequantized = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        prefix = f"{name}." if name else ""
        biases = params.pop(prefix + "biases", None)
        scales = params.pop(prefix + "scales")
        params[prefix + "weight"] = mx.dequantize(
            params[prefix + "weight"], scales, biases, group_size=module.group_size, bits=module.bits,
            mode=getattr(module, "mode", "affine"),
        )  # fmt: skip
        dequantized.append(name)
    return params, sorted(dequantized)


def _shared_copies(stored: dict[str, mx.array]) -> dict[str, mx.array]:
    """The draft's float copies of the target's embedding / head under DeepSpec's names."""
    out = {}
    for name in ("embed_tokens.weight", "embedding.weight"):
        if name in stored and mx.issubdtype(stored[name].dtype, mx.floating):
            out[EMBED] = stored[name]
    if HEAD in stored and mx.issubdtype(stored[HEAD].dtype, mx.floating):
        out[HEAD] = stored[HEAD]
    return out


def _target_copies(target: nn.Module) -> dict[str, mx.array]:
    """The target's embedding and LM head (the embedding again when tied), dequantized if need be."""
    params, _ = float_parameters(target)
    # found by identity, not by name: our modules and mlx-lm's classes (any wrapper) name them differently
    names = {id(module): name for name, module in target.named_modules()}

    def weight(module: nn.Module) -> mx.array:
        name = names[id(module)]
        return params[f"{name}.weight" if name else "weight"]

    embed = weight(target.embedding)
    head_module = target_head(target)
    return {EMBED: embed, HEAD: embed if head_module is target.embedding else weight(head_module)}


def read_draft_for_export(
    draft: str | Path,
    *,
    target: Optional[str | Path] = None,
    tap_ids: Optional[Sequence[int]] = None,
) -> ExportDraft:
    """The draft at `draft` (any format we load), checked against `target` when one is given.

    `tap_ids` overrides the draft's tapped layers (HF ids), as `load(draft_tap_ids=)` does for GGUF
    files from older converters."""
    draft_path = resolve_path(draft, role="draft")
    checkpoint = read_checkpoint(draft_path, role="draft", tap_ids=tap_ids)
    target_model, target_source = None, "target"
    if target is not None:
        target_path = resolve_path(target, role="target")
        target_checkpoint = read_checkpoint(target_path, role="target")
        target_model = build_target(target_checkpoint)
        target_source = target_checkpoint.config_source
    model, stored_shared = build_draft(checkpoint, target=target_model, target_source=target_source, tap_ids=tap_ids)
    weights, dequantized = float_parameters(model)
    notes = []
    if dequantized:
        bits = checkpoint.config.get("quantization", {}).get("bits", "?")
        notes.append(
            f"{draft_path}: {len(dequantized)} quantized layers ({bits}-bit) were dequantized; the export holds "
            "the dequantized values (re-export from the float checkpoint for the original weights)"
        )
    shared = _shared_copies(stored_shared)
    if target_model is not None and len(shared) < 2:
        shared = {**_target_copies(target_model), **shared}
    config = {k: v for k, v in checkpoint.config.items() if k not in ("quantization", "quantization_config")}
    if tap_ids is not None:
        config["target_layer_ids"] = list(tap_ids)
    return ExportDraft(
        path=draft_path,
        config=config,
        args=model.args,
        weights=weights,
        shared=shared,
        gguf_tokenizer=getattr(checkpoint, "tokenizer", None),
        notes=notes,
    )
