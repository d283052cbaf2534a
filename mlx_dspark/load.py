"""Loading a target (and optionally its DSpark draft): HF or MLX directories, sharded, quantized.

`load(target, draft=None, *, dtype=None, quantize=None, q_group_size=64)` returns a `LoadedModel`.
Weights are loaded lazily and checked strictly against the model built from config.json: a missing,
unexpected or mis-shaped tensor is a ValueError naming the file and the tensor. The draft's frozen
copies of the target's embedding / LM head are checked against the target's and dropped (shared).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dspark.checkpoint import load_weights, read_config, read_json, resolve_path
from mlx_dspark.precision import check_quantize_options, parse_dtype, quantizable
from mlx_dspark.models import DRAFT_ARCHITECTURES, DSPARK_MARKER_FIELDS, TARGET_ARCHITECTURES, target_module

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class LoadedModel:
    target: nn.Module
    draft: Optional[nn.Module]
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    target_config: dict
    draft_config: Optional[dict]
    target_path: Path
    draft_path: Optional[Path]


# -- config inspection ---------------------------------------------------------------------------


def is_draft_config(config: dict) -> bool:
    architectures = config.get("architectures") or []
    if isinstance(architectures, list) and architectures and architectures[0] in DRAFT_ARCHITECTURES:
        return True
    return all(k in config for k in DSPARK_MARKER_FIELDS)


def target_family(config: dict) -> str:
    return TARGET_ARCHITECTURES[config["architectures"][0]]


# -- weights into a module -------------------------------------------------------------------------


def apply_stored_quantization(model: nn.Module, config: dict, weights: dict[str, mx.array], *, source: Path) -> None:
    """Turn into quantized layers exactly the modules whose `.scales` the checkpoint holds, with the
    `quantization` block of config.json (per-layer entries as mlx-lm writes them override it)."""
    quant = config.get("quantization")
    if quant is None:
        if any(k.endswith(".scales") for k in weights):
            raise ValueError(f"{source}: the weights hold quantized tensors (*.scales) but config.json has no 'quantization' block")
        return
    if not isinstance(quant, dict) or "group_size" not in quant or "bits" not in quant:
        raise ValueError(f"{source}: config.json field 'quantization' must hold 'group_size' and 'bits', got {quant!r}")

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if f"{path}.scales" not in weights or not hasattr(module, "to_quantized"):
            return False
        override = quant.get(path)
        return override if isinstance(override, dict) else True

    nn.quantize(model, quant["group_size"], quant["bits"], mode=quant.get("mode", "affine"), class_predicate=predicate)


def check_tensors(
    expected: dict[str, tuple], found: dict[str, tuple], origin: dict[str, str], *, directory: Path, what: str
) -> None:
    """Strict: ValueError listing missing / unexpected tensors (with their files) and shape mismatches.

    expected / found: name -> shape; origin: name -> the file it came from."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensor(s) {missing}")
    if unexpected:
        problems.append("unexpected tensor(s) " + ", ".join(f"{k} (in {origin[k]})" for k in unexpected))
    if problems:
        raise ValueError(f"{directory}: the {what} weights do not match config.json: " + "; ".join(problems))
    wrong = [
        f"{k} in {origin[k]}: found {found[k]}, expected {expected[k]}" for k in sorted(found) if found[k] != expected[k]
    ]
    if len(wrong) > 8:
        wrong = wrong[:8] + [f"and {len(wrong) - 8} more"]
    if wrong:
        raise ValueError(f"{directory}: {what} tensor shape mismatch: " + "; ".join(wrong))


def check_weights(model: nn.Module, weights: dict[str, mx.array], origin: dict[str, Path], *, directory: Path, what: str) -> None:
    check_tensors(
        {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())},
        {k: tuple(v.shape) for k, v in weights.items()},
        {k: origin[k].name for k in weights},
        directory=directory,
        what=what,
    )


def cast_floating(weights: dict[str, mx.array], dtype: Optional[mx.Dtype]) -> dict[str, mx.array]:
    if dtype is None:
        return weights
    return {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}


def _build_and_fill(module_cls, args, weights, origin, config, *, directory: Path, what: str, dtype) -> nn.Module:
    model = module_cls(args)
    weights = model.sanitize(weights)
    apply_stored_quantization(model, config, weights, source=directory)
    check_weights(model, weights, origin, directory=directory, what=what)
    model.update(tree_unflatten(list(cast_floating(weights, dtype).items())))
    return model


# -- target / draft ------------------------------------------------------------------------------


def load_target(path: Path, *, dtype: Optional[mx.Dtype] = None) -> tuple[nn.Module, dict, dict[str, mx.array]]:
    """(model, config, raw weights) of a target directory; the model's weights are not evaluated."""
    config = read_config(path)
    source = str(path / "config.json")
    if is_draft_config(config):
        raise ValueError(f"{source}: this is a DSpark draft (architectures {config.get('architectures')}); pass it as draft=, with its target")
    module = target_module(config, source=source)
    args = module.ModelArgs.from_dict(config, source=source)
    weights, origin = load_weights(path)
    model = _build_and_fill(module.Model, args, dict(weights), origin, config, directory=path, what="target", dtype=dtype)
    return model, config, weights


def read_draft_config(path: Path) -> dict:
    """The draft's config.json, checked to be a complete DSpark config (before any weight is read)."""
    from mlx_dspark.models.dspark import DraftArgs

    config = read_config(path)
    source = str(path / "config.json")
    if not is_draft_config(config):
        raise ValueError(
            f"{source}: not a DSpark draft: architectures {config.get('architectures')} and not all of the DSpark "
            f"fields {list(DSPARK_MARKER_FIELDS)}; pass a draft directory as draft="
        )
    DraftArgs.from_dict(config, source=source)
    return config


def load_draft(path: Path, config: dict, *, dtype: Optional[mx.Dtype] = None) -> tuple[nn.Module, dict[str, mx.array]]:
    """(draft, its shared tensors as stored: embed_tokens / embedding / lm_head, possibly none)."""
    from mlx_dspark.models.dspark import SHARED_PREFIXES, DraftArgs, DSparkDraft

    source = str(path / "config.json")
    args = DraftArgs.from_dict(config, source=source)
    weights, origin = load_weights(path)
    shared = {k: v for k, v in weights.items() if k.startswith(SHARED_PREFIXES)}
    model = _build_and_fill(DSparkDraft, args, dict(weights), origin, config, directory=path, what="draft", dtype=dtype)
    return model, shared


def _target_tensor(weights: dict[str, mx.array], config: dict, name: str) -> Optional[tuple[mx.array, Optional[tuple]]]:
    """The target's float embedding (`name="embed"`) or LM head, as (array, quantization) where the
    quantization is (scales, biases, group_size, bits) for a stored quantized tensor."""
    embed = "model.embedding" if target_family(config) == "spark2_5" else "model.embed_tokens"
    prefix = "lm_head" if name == "head" and "lm_head.weight" in weights else embed  # tied: the embedding
    if f"{prefix}.weight" not in weights:
        return None
    if f"{prefix}.scales" in weights:
        quant = config["quantization"]
        override = quant.get(prefix) if isinstance(quant.get(prefix), dict) else quant
        return weights[f"{prefix}.weight"], (
            weights[f"{prefix}.scales"], weights.get(f"{prefix}.biases"), override["group_size"], override["bits"],
        )
    return weights[f"{prefix}.weight"], None


def check_shared_tensors(
    shared: dict[str, mx.array], target_weights: dict[str, mx.array], target_config: dict, *, draft_path: Path
) -> None:
    """The draft's copies of the embedding / LM head must be the target's (up to storage precision)."""
    for name, array in shared.items():
        kind = "head" if name.startswith("lm_head.") else "embed"
        if not name.endswith(".weight"):
            raise ValueError(f"{draft_path}: shared tensor {name!r} is not a plain weight (quantized copies are not supported)")
        found = _target_tensor(target_weights, target_config, kind)
        if found is None:
            raise ValueError(f"{draft_path}: draft tensor {name!r} has no counterpart in the target")
        reference, quant = found
        ref_shape = tuple(reference.shape) if quant is None else (reference.shape[0], quant[0].shape[1] * quant[2])
        if tuple(array.shape) != ref_shape:
            raise ValueError(
                f"{draft_path}: draft tensor {name!r} has shape {tuple(array.shape)} but the target's is {ref_shape}; "
                "the draft was trained for another target"
            )
        if not _same_tensor(array, reference, quant):
            raise ValueError(
                f"{draft_path}: draft tensor {name!r} differs from the target's {kind} weights; "
                "the draft was trained for another target (or another revision of it)"
            )


def _same_tensor(draft: mx.array, target: mx.array, quant: Optional[tuple], *, rows: int = 8192) -> bool:
    # Row chunks in float32, so a large vocabulary never needs a full float32 copy.
    low_precision = draft.dtype != mx.float32 or (quant is None and target.dtype != mx.float32)
    for start in range(0, draft.shape[0], rows):
        d = draft[start : start + rows].astype(mx.float32)
        if quant is None:
            t = target[start : start + rows].astype(mx.float32)
            tol = (1e-2 if low_precision else 1e-6) * mx.abs(t) + 1e-5
        else:
            scales, biases, group_size, bits = quant
            s, b = scales[start : start + rows], None if biases is None else biases[start : start + rows]
            t = mx.dequantize(target[start : start + rows], s, b, group_size=group_size, bits=bits).astype(mx.float32)
            # MLX's affine quantization is off by up to one step; plus the draft's own storage rounding
            step = mx.repeat(mx.abs(s.astype(mx.float32)), group_size, axis=-1)  # scales may be negative
            tol = 1.01 * step + 1e-2 * mx.abs(t) + 1e-5
        if not mx.all(mx.abs(d - t) <= tol).item():
            return False
    return True


def validate_pair(target_config: dict, draft_config: dict, *, target_path: Path, draft_path: Path) -> None:
    """Same family, hidden size and vocabulary; taps inside the target and not its last layer; mask in vocab."""
    from mlx_dspark.models import draft_family

    def mismatch(field_name: str, draft_value: Any, target_value: Any, why: str) -> ValueError:
        return ValueError(
            f"{draft_path / 'config.json'}: {field_name} is {draft_value!r} but the target "
            f"({target_path / 'config.json'}) has {target_value!r}: {why}"
        )

    family, tfamily = draft_family(draft_config, source=str(draft_path / "config.json")), target_family(target_config)
    if family != tfamily:
        raise mismatch("the layer family", family, tfamily, "a draft only works with a target of its own family")
    for field_name in ("hidden_size", "vocab_size"):
        if draft_config.get(field_name) != target_config.get(field_name):
            raise mismatch(field_name, draft_config.get(field_name), target_config.get(field_name), "they must be equal")
    num_layers = target_config["num_hidden_layers"]
    bad = [i for i in draft_config["target_layer_ids"] if not -1 <= i <= num_layers - 2]
    if bad:
        raise ValueError(
            f"{draft_path / 'config.json'}: target_layer_ids {draft_config['target_layer_ids']} has {bad} outside "
            f"[-1, {num_layers - 2}] (the target has num_hidden_layers {num_layers}; its last layer is never tapped)"
        )
    declared = draft_config.get("num_target_layers")
    if declared is not None and declared != num_layers:
        raise mismatch("num_target_layers", declared, num_layers, "the draft was trained on a target with another depth")
    mask = draft_config["mask_token_id"]
    if not 0 <= mask < target_config["vocab_size"]:
        raise ValueError(
            f"{draft_path / 'config.json'}: mask_token_id {mask} is outside the target's vocabulary "
            f"[0, {target_config['vocab_size']})"
        )


# -- tokenizer -----------------------------------------------------------------------------------


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

    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"{path}: no tokenizer files (expected one of {list(_TOKENIZER_FILES)}); the target directory must carry its tokenizer")
    # A Spark config names custom code (auto_map): we never run it. trust_remote_code=False keeps
    # transformers from stopping to ask; a blank model config keeps it from reading config.json at all.
    extra: dict[str, Any] = {"trust_remote_code": False}
    if "auto_map" in config:
        from transformers import PretrainedConfig

        extra["config"] = PretrainedConfig()
    return mlx_lm_load_tokenizer(path, extra, eos_token_ids=eos_token_ids(path, config) or None)


# -- public entry --------------------------------------------------------------------------------


def load(
    target: str | Path,
    draft: str | Path | None = None,
    *,
    dtype: str | mx.Dtype | None = None,
    quantize: Optional[int] = None,
    q_group_size: int = 64,
) -> LoadedModel:
    """Load a target and optionally its DSpark draft (local directories or Hugging Face repo ids).

    dtype: cast floating weights ("bfloat16", "float16", "float32"); quantize: 4 or 8 bits at load
    time (layers whose input dim is not a multiple of `q_group_size` stay in float; norms always do).
    """
    mx_dtype = parse_dtype(dtype)
    if quantize is not None:
        check_quantize_options(bits=quantize, group_size=q_group_size)
    target_path = resolve_path(target, role="target")
    target_model, target_config, target_weights = load_target(target_path, dtype=mx_dtype)
    if quantize is not None and "quantization" in target_config:
        raise ValueError(
            f"{target_path / 'config.json'}: the checkpoint is already quantized ({target_config['quantization']}); "
            "load it without quantize="
        )
    tokenizer = load_tokenizer(target_path, target_config)

    draft_model = draft_config = draft_path = None
    if draft is not None:
        draft_path = resolve_path(draft, role="draft")
        draft_config = read_draft_config(draft_path)
        validate_pair(target_config, draft_config, target_path=target_path, draft_path=draft_path)
        draft_model, shared = load_draft(draft_path, draft_config, dtype=mx_dtype)
        check_shared_tensors(shared, target_weights, target_config, draft_path=draft_path)
    del target_weights

    if quantize is not None:
        for model in (target_model, draft_model):
            if model is not None:
                nn.quantize(
                    model,
                    q_group_size,
                    quantize,
                    class_predicate=lambda p, m: quantizable(p, m, group_size=q_group_size),
                )
    for model in (target_model, draft_model):
        if model is not None:
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
