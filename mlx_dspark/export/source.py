"""A draft to export, read from any checkpoint we load (DeepSpec / Spark / z-lab safetensors, our MLX
layout, MLX-quantized, GGUF; EAGLE-3 in speculators' layout): its config and its float weights under
DeepSpec's names (a DFlash 2 draft's convolutions and selector under z-lab's, an EAGLE-3 draft's under
speculators').

The draft is built exactly as `mlx_dspark.load` builds it (the same config parsing, the same strict
tensor checks; with a target, the pair checks too), then its parameters are read back: what the
exporters write is what our loader would compute with. MLX-quantized layers are dequantized (their
affine groups expanded to the scales' dtype) and the export says so: the exported file holds the
dequantized values, not the original float weights the quantization came from.

The draft's frozen copies of the target's embedding and LM head are kept apart (`shared`): from the
draft's own file when it has float copies, else from the target (DeepSpec's layout stores them; a
GGUF draft leaves them out and uses the target's). An EAGLE-3 draft's copy of the target's embedding
is kept apart the same way (`EMBED`).

The target's own MTP layers are no draft file: asked for (`mtp`, `PATH,mtp`, or a target checkpoint
that carries them), the export refuses in one line saying where they live; a Gemma 4 assistant drafter
has no export format (refused in one line too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_dspark.loading.checkpoint import Checkpoint, read_checkpoint, resolve_path
from mlx_dspark.loading.heads.eagle3 import build_eagle3
from mlx_dspark.loading.load import build_draft, build_target, split_draft
from mlx_dspark.loading.heads.mtp import MTP_DRAFT, supports_mtp
from mlx_dspark.models.heads.dspark.args import DraftArgs, is_draft_config
from mlx_dspark.models.heads.eagle3.args import Eagle3Args, is_eagle3_config
from mlx_dspark.models.heads.gemma4_assistant.model import is_assistant_config
from mlx_dspark.models.target.lm_head import target_head

EMBED, HEAD = "embed_tokens.weight", "lm_head.weight"
MTP_LAYERS = (
    "the target's own MTP layers are part of its checkpoint, not a draft file, so there is nothing to export: "
    "`python -m mlx_dspark.convert TARGET` keeps them with the target (--draft mtp loads them)"
)


@dataclass
class ExportDraft:
    path: Path  # where it was read from
    config: dict[str, Any]  # as read (config.json layout; a GGUF's rebuilt), without quantization fields
    args: DraftArgs | Eagle3Args
    weights: dict[str, mx.array]  # DeepSpec names, float, without the shared copies (EAGLE-3: its module names)
    shared: dict[str, mx.array] = field(default_factory=dict)  # EMBED / HEAD when known
    gguf_tokenizer: Any = None  # the tokenizer material of a GGUF source (`GGUFTokenizer`), if any
    notes: list[str] = field(default_factory=list)  # what the user should know about the export

    @property
    def kind(self) -> str:
        """Which graph the draft runs, and so which formats can hold it: "dspark" (DSpark and DFlash: one
        graph), "dflash2" or "eagle3"."""
        if isinstance(self.args, Eagle3Args):
            return "eagle3"
        return "dflash2" if self.args.dflash2 is not None else "dspark"


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
    draft = _one_draft(draft)
    draft_path = resolve_path(draft, role="draft")
    checkpoint = read_checkpoint(draft_path, role="draft", tap_ids=tap_ids)
    if not is_draft_config(checkpoint.config) and not is_eagle3_config(checkpoint.config) and supports_mtp(checkpoint.config):
        raise ValueError(f"{checkpoint.config_source}: a target, not a draft; {MTP_LAYERS}")
    if is_assistant_config(checkpoint.config):
        raise ValueError(f"{checkpoint.config_source}: a Gemma 4 assistant drafter: export has no format for it; "
                         "use its published files as they are (--draft DIR)")  # fmt: skip
    target_model, target_source = None, "target"
    if target is not None:
        target_path = resolve_path(target, role="target")
        target_checkpoint = read_checkpoint(target_path, role="target")
        target_model = build_target(target_checkpoint)
        target_source = target_checkpoint.config_source
    if is_eagle3_config(checkpoint.config):
        if tap_ids is not None:
            raise ValueError(f"{checkpoint.config_source}: --draft-tap-ids applies to DSpark GGUF drafts; an EAGLE-3 draft's "
                             "taps are its eagle_aux_hidden_state_layer_ids: drop it")  # fmt: skip
        return _eagle3_for_export(checkpoint, target=target_model, target_source=target_source)
    model, stored_shared = build_draft(checkpoint, target=target_model, target_source=target_source, tap_ids=tap_ids)
    weights, notes = _float_weights(model, checkpoint)
    shared = _shared_copies(stored_shared)
    if target_model is not None and len(shared) < 2:
        shared = {**_target_copies(target_model), **shared}
    config = _config(checkpoint)
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


def _one_draft(draft: str | Path) -> str | Path:
    """The draft model of `draft`; ValueError for the target's MTP layers, alone or beside a draft."""
    models, own_heads = split_draft(str(draft)) if isinstance(draft, str) else ([draft], [])
    use_mtp = MTP_DRAFT in own_heads
    if use_mtp and not models:
        raise ValueError(f"draft {MTP_DRAFT!r}: {MTP_LAYERS}")
    if use_mtp:
        raise ValueError(f"draft {draft!r}: pass {models[0]!r} alone (the target's MTP layers stay in its checkpoint: nothing to export)")
    if len(models) > 1:
        raise ValueError(f"draft {draft!r}: export one draft at a time, e.g. {models[0]!r}")
    return draft


def _config(checkpoint: Checkpoint) -> dict[str, Any]:
    return {k: v for k, v in checkpoint.config.items() if k not in ("quantization", "quantization_config")}


def _float_weights(model: nn.Module, checkpoint: Checkpoint) -> tuple[dict[str, mx.array], list[str]]:
    """(the model's float parameters, a note when quantized layers had to be dequantized)."""
    weights, dequantized = float_parameters(model)
    notes = []
    if dequantized:
        bits = checkpoint.config.get("quantization", {}).get("bits", "?")
        notes.append(
            f"{checkpoint.path}: {len(dequantized)} quantized layers ({bits}-bit) were dequantized; the export holds "
            "the dequantized values (re-export from the float checkpoint for the original weights)"
        )
    return weights, notes


def _eagle3_for_export(checkpoint: Checkpoint, *, target: Optional[nn.Module], target_source: str) -> ExportDraft:
    """An EAGLE-3 draft (speculators' or SpecForge's names), checked against `target` when one is given;
    its copy of the target's embedding from its own file, else from the target."""
    model = build_eagle3(checkpoint, target=target, target_source=target_source)
    weights, notes = _float_weights(model, checkpoint)
    shared = {} if model.args.own_embedding else _shared_copies({k: v for k, v in checkpoint.weights.items() if k == EMBED})
    if target is not None and not shared and not model.args.own_embedding:
        shared = {EMBED: _target_copies(target)[EMBED]}
    return ExportDraft(path=Path(checkpoint.path), config=_config(checkpoint), args=model.args, weights=weights, shared=shared, notes=notes)
