"""A draft against its target: the pair checks and the shared embedding / LM head comparison.

The pair checks are the ones that matter for correctness: hidden size, vocabulary, tapped layers
inside the target (never its last), the mask token inside the vocabulary. The draft's layer family may
differ from the target's (DSPARK.md section 6).
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import numpy as np
import mlx.nn as nn

from mlx_dspark.models.target.lm_head import head_as_loaded, target_head
from mlx_dspark.models.heads.dspark.args import DraftArgs


# mlx-lm families whose model multiplies the input embedding by sqrt(hidden_size) (Gemma's scaled embedding)
SCALED_INPUT_EMBEDDINGS = ("gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma4", "gemma4_text")


def check_zlab_block_embedding(target: Any, draft: DraftArgs, *, zlab: bool, target_source: str, draft_source: str) -> None:
    """Refuse a z-lab DFlash / DFlash 2 draft with plain (Qwen3) layers beside a target whose model scales
    its input embedding: z-lab's runtime embeds the block through the target's embedding module (mlx-vlm
    times the target's embed_scale), scale included; ours gives such a draft the raw table."""
    kind = getattr(target, "mlx_lm_model_type", None)
    if zlab and kind in SCALED_INPUT_EMBEDDINGS and getattr(draft.layers, "embedding_scale", None) is None:
        raise ValueError(
            f"{draft_source}: a z-lab DFlash / DFlash 2 draft with {draft.family}-style layers beside a {kind} target "
            f"({target_source}), whose embedding scales by sqrt(hidden_size): "
            "z-lab's runtime embeds the draft's block with that scale, which we do not apply to such a draft; not supported"
        )


def validate_pair(
    target_args: Any, draft: DraftArgs, *, target_source: str, draft_source: str, taps_field: str = "target_layer_ids"
) -> None:
    """ValueError naming the draft's field and the target's value for a pair that cannot work.

    `taps_field` names where the tap ids came from (the config field, or an override option)."""

    def mismatch(field_name: str, draft_value: Any, target_value: Any, why: str) -> ValueError:
        return ValueError(
            f"{draft_source}: {field_name} is {draft_value!r} but the target ({target_source}) has {target_value!r}: {why}"
        )

    for field_name in ("hidden_size", "vocab_size"):
        if getattr(draft, field_name) != getattr(target_args, field_name):
            raise mismatch(field_name, getattr(draft, field_name), getattr(target_args, field_name), "they must be equal")
    num_layers = target_args.num_hidden_layers
    ids = list(draft.target_layer_ids)
    bad = [i for i in ids if not -1 <= i <= num_layers - 2]
    if bad:
        raise ValueError(
            f"{draft_source}: {taps_field} {ids} has {bad} outside [-1, {num_layers - 2}] (the target has "
            f"num_hidden_layers {num_layers}; its last layer is never tapped)"
        )
    if draft.num_target_layers is not None and draft.num_target_layers != num_layers:
        raise mismatch("num_target_layers", draft.num_target_layers, num_layers, "the draft was trained on a target with another depth")
    if not 0 <= draft.mask_token_id < target_args.vocab_size:
        raise ValueError(
            f"{draft_source}: mask_token_id {draft.mask_token_id} is outside the target's vocabulary "
            f"[0, {target_args.vocab_size})"
        )


# A GGUF draft's quantized copy of a target tensor (read dequantized) is within one step of the source in
# each group of its type: (group size, how the step is read off the group's values, grid levels). Symmetric
# types map the group's largest |weight| to the grid's end (step = amax / levels), affine ones spread the
# group's range over the grid (step = (max - min) / levels).
GGUF_COPY_STEPS = {
    "Q8_0": (32, "amax", 127), "Q5_0": (32, "amax", 16), "Q4_0": (32, "amax", 8),
    "Q5_1": (32, "range", 31), "Q4_1": (32, "range", 15),
    "Q6_K": (16, "amax", 32), "Q5_K": (32, "range", 31), "Q4_K": (32, "range", 15),
    "Q3_K": (16, "amax", 4), "Q2_K": (16, "range", 3),
}  # fmt: skip
FLOAT_STORAGE = ("F32", "F16", "BF16")


# A draft's own embedding may differ from the target's in this many rows at most (a trained mask row, as
# drafts that ship `mask_embedding.pt` have; upstream's runtime then embeds with the draft's table).
MAX_OWN_EMBEDDING_ROWS = 16


def check_shared_tensors(
    shared: dict[str, mx.array], target: Any, *, draft_source: str, storage: Optional[dict[str, str]] = None
) -> dict[int, mx.array]:
    """The draft's copies of the embedding / LM head must be the target's (up to storage precision),
    except for at most MAX_OWN_EMBEDDING_ROWS embedding rows: those are returned (row id -> the
    draft's row) for `DSparkDraft.set_embedding_rows`.

    `target` is the built target model (before any load-time quantization; stored quantization is
    compared through its dequantized values). `storage`: name -> the GGUF type a copy was stored as
    (a GGUF draft's; absent: the array's own dtype); a quantized copy may differ from the target's by
    one step of its type, on top of the target's own storage precision."""
    storage = storage or {}
    own_rows: dict[int, mx.array] = {}
    for name, array in shared.items():
        kind = "head" if name.startswith("lm_head.") else "embed"
        if not name.endswith(".weight"):
            raise ValueError(f"{draft_source}: shared tensor {name!r} is not a plain weight (quantized copies are not supported)")
        stored = storage.get(name)
        if stored is not None and stored not in FLOAT_STORAGE and stored not in GGUF_COPY_STEPS:
            raise ValueError(
                f"{draft_source}: draft tensor {name!r} is stored as {stored}; a copy of the target's {kind} in that "
                f"type cannot be compared with the target's (supported: {', '.join(FLOAT_STORAGE + tuple(GGUF_COPY_STEPS))}); "
                "use a draft file without the copy or with it in BF16"
            )
        module = target_head(target) if kind == "head" else target.embedding
        quant = _quantization(module)
        reference = module.weight
        ref_shape = tuple(reference.shape) if quant is None else (reference.shape[0], quant[0].shape[1] * quant[2])
        if tuple(array.shape) != ref_shape:
            raise ValueError(
                f"{draft_source}: draft tensor {name!r} has shape {tuple(array.shape)} but the target's is {ref_shape}; "
                "the draft was trained for another target"
            )
        rows = _differing_rows(array, reference, quant, copy_step=GGUF_COPY_STEPS.get(stored or ""))
        if rows and kind == "head":  # the copy as stored, the target's as it computes with it (a head normalized at load)
            loaded = head_as_loaded(target, array)
            if loaded is not None:
                rows = _differing_rows(loaded, reference, quant, copy_step=GGUF_COPY_STEPS.get(stored or ""))
        if rows and (kind != "embed" or len(rows) > MAX_OWN_EMBEDDING_ROWS):
            stored_as = f" (stored as {stored})" if stored else ""
            raise ValueError(
                f"{draft_source}: draft tensor {name!r}{stored_as} differs from the target's {kind} weights"
                f"{f' in at least {len(rows)} rows (up to {MAX_OWN_EMBEDDING_ROWS} may be its own, e.g. a mask row)' if kind == 'embed' else ''}"
                "; the draft was trained for another target "
                "(or another revision of it)"
            )
        own_rows.update({row: array[row] for row in rows})
    return own_rows


def _quantization(module: nn.Module) -> Optional[tuple]:
    """(scales, biases, group_size, bits) of a quantized embedding / linear, else None."""
    if not hasattr(module, "scales"):
        return None
    return module.scales, getattr(module, "biases", None), module.group_size, module.bits


def _copy_tolerance(draft: mx.array, copy_step: tuple[int, str, int]) -> mx.array:
    """One quantization step of the draft's copy, per weight (rows, cols), read off its own groups."""
    group, how, levels = copy_step
    rows, cols = draft.shape
    groups = draft.reshape(rows, cols // group, group)
    if how == "amax":
        span = mx.max(mx.abs(groups), axis=-1, keepdims=True)
    else:
        span = mx.max(groups, axis=-1, keepdims=True) - mx.min(groups, axis=-1, keepdims=True)
    return mx.broadcast_to(1.01 * span / levels, groups.shape).reshape(rows, cols)


def _differing_rows(
    draft: mx.array, target: mx.array, quant: Optional[tuple], *, copy_step: Optional[tuple] = None, rows: int = 8192
) -> list[int]:
    """Row ids where the copy differs from the target's (up to MAX_OWN_EMBEDDING_ROWS + 1 of them)."""
    # Row chunks in float32, so a large vocabulary never needs a full float32 copy.
    found: list[int] = []
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
        if copy_step is not None:
            tol = tol + _copy_tolerance(d, copy_step)
        close = mx.all(mx.abs(d - t) <= tol, axis=-1)
        if not mx.all(close).item():
            found.extend(start + int(i) for i in np.flatnonzero(~np.array(close)))
            if len(found) > MAX_OWN_EMBEDDING_ROWS:
                break
    return found
