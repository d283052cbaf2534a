"""A target's own MTP layers (`load(target, draft="mtp")`, `--draft mtp`): read from the target's checkpoint.

One layout per model module (dispatch on model_type):
- Qwen3.5 / 3.6 / 3.8, dense or MoE (`qwen3_5`, `qwen3_5_moe`): `mtp.*` tensors, `text_config.mtp_num_hidden_layers`
  (`models/heads/mtp/qwen3_5.py`);
- Qwen3-Next (`qwen3_next`): `mtp.*` tensors, `num_nextn_predict_layers` or 1 when absent (`models/heads/mtp/qwen3_next.py`);
- Nemotron-H (`nemotron_h`): `mtp.layers.<j>.*`, `num_nextn_predict_layers` and `mtp_layers_block_type`
  (`models/heads/mtp/nemotron_h.py`);
- DeepSeek-V3 (`deepseek_v3`) and GLM-4.5+ (`glm4_moe`): next-n layers at `model.layers.<num_hidden_layers + i>.*`,
  `num_nextn_predict_layers` (`models/heads/mtp/deepseek.py`);
- MiMo (`mimo`): `model.mtp_layers.<i>.*`, `num_nextn_predict_layers` (`models/heads/mtp/mimo.py`).

mlx-lm's sanitize drops these tensors, so the target model never sees them (we drop them before it too:
`target_weights`); they are taken here from the same checkpoint into the MTP module. MLX conversions made
by mlx-lm lack them; ours (`python -m mlx_dspark.convert`) keep them.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dspark.loading.checkpoint import Checkpoint, read_header, weight_files
from mlx_dspark.loading.weights import fill_model
from mlx_dspark.models.heads.mtp import deepseek as mtp_deepseek
from mlx_dspark.models.heads.mtp import mimo as mtp_mimo
from mlx_dspark.models.heads.mtp import nemotron_h as mtp_nemotron_h
from mlx_dspark.models.heads.mtp import qwen3_5 as mtp_qwen3_5
from mlx_dspark.models.heads.mtp import qwen3_next as mtp_qwen3_next

MTP_DRAFT = "mtp"  # the `draft=` / `--draft` value naming the target's own MTP layers
_MODULES = {
    **dict.fromkeys(mtp_qwen3_5.MODEL_TYPES, mtp_qwen3_5),
    **dict.fromkeys(mtp_deepseek.MODEL_TYPES, mtp_deepseek),
    **dict.fromkeys(mtp_mimo.MODEL_TYPES, mtp_mimo),
    **dict.fromkeys(mtp_qwen3_next.MODEL_TYPES, mtp_qwen3_next),
    **dict.fromkeys(mtp_nemotron_h.MODEL_TYPES, mtp_nemotron_h),
}
# the families whose published checkpoints carry one MTP layer (more is refused, by name: for Qwen3.5 the readings
# differ too, vLLM's step k runs layer k mod n, mlx-vlm's runs every layer in order)
_ONE_LAYER = {mtp_deepseek: "DeepSeek-V3 / GLM-4.5", mtp_mimo: "MiMo-7B", mtp_qwen3_next: "Qwen3-Next", mtp_nemotron_h: "Nemotron-H",
              mtp_qwen3_5: "Qwen3.5 / 3.6 / 3.8"}  # fmt: skip
MODEL_TYPES = tuple(_MODULES)


def _module(config: dict) -> Any:
    return _MODULES.get(config.get("model_type"))


def mtp_layer_count(config: dict) -> int:
    """How many MTP layers a target config declares (0: none, or a family we do not build)."""
    module = _module(config)
    if module is None:
        return 0
    return mtp_deepseek.nextn_layer_count(config) if module is mtp_deepseek else module.mtp_layer_count(config)


def supports_mtp(config: dict) -> bool:
    """Whether a target config declares MTP layers of a family we build."""
    return mtp_layer_count(config) > 0


def runs_mtp(config: dict) -> bool:
    """Whether `draft="mtp"` runs the layers the config declares (more than one of a family whose published
    checkpoints carry one is refused: `build_mtp`)."""
    return supports_mtp(config) and not (_module(config) in _ONE_LAYER and mtp_layer_count(config) > 1)


def declares_mtp(config: dict) -> bool:
    """Whether the config itself names the layers: a Qwen3-Next config without `num_nextn_predict_layers` (the
    published ones) is not taken at its word (only its files can say)."""
    if _module(config) is mtp_qwen3_next:
        return mtp_qwen3_next.declares_layers(config)
    return supports_mtp(config)


def is_mtp_tensor(config: dict, name: str) -> bool:
    module = _module(config)
    return module is not None and mtp_layer_count(config) > 0 and module.owns(config, name)


def target_weights(config: dict, weights: dict[str, Any]) -> dict[str, Any]:
    """The target's own tensors: without its MTP layers (mlx-lm drops them in its sanitize too, but
    DeepSeek's only at layer 61, whatever the config)."""
    if not supports_mtp(config):
        return weights
    return {k: v for k, v in weights.items() if not is_mtp_tensor(config, k)}


def _tensor_names(config: dict) -> str:
    if _module(config) in (mtp_qwen3_5, mtp_qwen3_next):
        return "mtp.*"
    return " / ".join(p + "*" for p in _module(config).layer_prefixes(config))


def how_to_get(source: str, config: Optional[dict] = None) -> str:
    names = _tensor_names(config) if config is not None and supports_mtp(config) else "the MTP tensors"
    return (
        f"load the original Hugging Face checkpoint instead (its safetensors hold {names}), or convert that with "
        f"`python -m mlx_dspark.convert` (which keeps them); an mlx-lm conversion ({source}) drops them"
    )


def mtp_skeleton(config: dict, shapes: dict[str, Any], *, source: str) -> Optional[nn.Module]:
    """The MTP module of a target (lazy parameters) when its config declares the layers and the checkpoint's
    tensors (name -> shape) hold them; None otherwise. The tensors say what the module holds: raw HF norms
    (Qwen), the next-n layers' own copies of the embedding / LM head (DeepSeek, GLM)."""
    module = _module(config)
    if module is None or not any(is_mtp_tensor(config, name) for name in shapes):
        return None
    if module is mtp_qwen3_5:
        return mtp_qwen3_5.MTP(mtp_qwen3_5.MTPArgs.from_dict(config, source=source), raw_norms=mtp_qwen3_5.is_raw_hf(shapes))
    if module is mtp_qwen3_next:
        return mtp_qwen3_next.MTP(mtp_qwen3_next.mtp_args(config, source=source), raw_norms=mtp_qwen3_next.is_raw_hf(shapes))
    if module is mtp_mimo:  # the embedding and the LM head are always the target's
        return mtp_mimo.MTP(mtp_mimo.MiMoMTPArgs.from_dict(config, source=source))
    if module is mtp_nemotron_h:
        return mtp_nemotron_h.MTP(mtp_nemotron_h.NemotronHMTPArgs.from_dict(config, source=source))
    prefixes = mtp_deepseek.layer_prefixes(config)
    return mtp_deepseek.MTP(
        mtp_deepseek.NextNArgs.from_dict(config, source=source),
        own_embedding=f"{prefixes[0]}embed_tokens.weight" in shapes,
        own_head=all(f"{p}shared_head.head.weight" in shapes for p in prefixes),
    )


def _declared(config: dict, count: int) -> str:
    if declares_mtp(config):
        return f"the config declares {count} MTP layer(s)"
    return f"a {config.get('model_type')} target's MTP layer is in its original files"


def build_mtp(checkpoint: Checkpoint, *, dtype: Optional[mx.Dtype] = None) -> nn.Module:
    """The MTP layers of a target checkpoint (lazy weights); one clear ValueError when there are none."""
    config, source = checkpoint.config, checkpoint.config_source
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"{source}: draft 'mtp': model_type {model_type!r} has no MTP layers we can run (supported: "
            f"{', '.join(MODEL_TYPES)}); pass a DSpark draft, --draft lookup, or --no-draft"
        )
    count = mtp_layer_count(config)
    field = "text_config.mtp_num_hidden_layers" if _module(config) is mtp_qwen3_5 else "num_nextn_predict_layers"
    if count < 1:
        raise ValueError(
            f"{source}: draft 'mtp': {field} is absent or 0, so this target carries no MTP "
            "layers; pass a DSpark draft, --draft lookup, or --no-draft"
        )
    if _module(config) in _ONE_LAYER and count > 1:
        family = _ONE_LAYER[_module(config)]
        raise ValueError(
            f"{source}: draft 'mtp': {field} is {count}; only 1 is supported (every published "
            f"{family} checkpoint has 1: with more, what the later layers' caches hold over the committed "
            "positions is not defined by the chained proposal we follow); pass --no-draft or a DSpark draft"
        )
    weights = {k: v for k, v in checkpoint.weights.items() if is_mtp_tensor(config, k)}
    model = mtp_skeleton(config, {k: v.shape for k, v in checkpoint.weights.items()}, source=source)
    if model is None:
        raise ValueError(
            f"{checkpoint.path}: draft 'mtp': {_declared(config, count)} but the weights hold no {_tensor_names(config)} tensors; {how_to_get(str(checkpoint.path), config)}"
        )
    # a renamed tensor (stacked experts, split kv_b_proj) is named in messages by the files holding the layers
    origin = defaultdict(lambda: ", ".join(sorted({checkpoint.origin[k] for k in weights})))
    model = fill_model(
        model, config, weights, origin,
        source=str(checkpoint.path), what="MTP layers", dtype=checkpoint.default_dtype if dtype is None else dtype,
        config_name=Path(source).name,
    )  # fmt: skip
    model.eval()
    return model


def quantize_mtp(model: nn.Module, *, bits: int, group_size: int) -> None:
    """The MTP's linear layers at the target's load-time precision (its norms stay in float)."""
    nn.quantize(model, group_size, bits, class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0)


def has_mtp_tensors(path: str | Path, config: dict) -> bool:
    """Whether a local checkpoint directory's safetensors hold the MTP tensors `config` declares (headers only)."""
    try:
        return any(is_mtp_tensor(config, name) for file in weight_files(Path(path)) for name in read_header(file))
    except (OSError, ValueError):
        return False


# -- the head's loader declarations (loading/heads/__init__.py) ---------------------------------------------
DESCRIPTION = "the target's own MTP layers"
HELP = ("the target's own multi-token-prediction layers (Qwen3.5 / 3.6 / 3.8 checkpoints with mtp.*, DeepSeek-V3 / "
        "GLM-4.5+ checkpoints with their next-n layer, MiMo checkpoints with model.mtp_layers.*, Qwen3-Next checkpoints with mtp.*, "
        "Nemotron-H checkpoints with mtp.layers.*)")  # --draft's help
FROM_TARGET = True  # named in draft= as "mtp", read from the target's checkpoint


def detect(config: dict) -> bool:
    return False  # no draft file of its own


def build_from_target(checkpoint: Checkpoint, *, dtype: Optional[mx.Dtype] = None) -> nn.Module:
    return build_mtp(checkpoint, dtype=dtype)


quantize = quantize_mtp
