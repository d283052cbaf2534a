"""Precision options, validated in one place: floating dtypes, MLX quantization bits and group sizes,
and which layers quantize."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
Q_BITS = (4, 8)
Q_GROUP_SIZES = (32, 64, 128)
# What stays in source precision when the draft is quantized on its own (draft_quantize=), per bit width,
# as module path prefixes: chosen by the acceptance measured on the demo pair (benchmarks/RESULTS.md,
# "Issue 20"): an 8-bit Markov head cost nothing measurable, a 4-bit one did; the confidence head is
# tiny and calibrated, so it always stays.
DRAFT_SOURCE_PRECISION = {8: ("confidence_head",), 4: ("markov_head", "confidence_head")}


def parse_dtype(dtype: str | mx.Dtype | None) -> Optional[mx.Dtype]:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def check_quantize_options(*, bits: Optional[int], group_size: int) -> None:
    if bits is not None and bits not in Q_BITS:
        raise ValueError(f"quantize bits {bits!r} are not supported; expected one of {Q_BITS}")
    if group_size not in Q_GROUP_SIZES:
        raise ValueError(f"quantization group size {group_size!r} is not supported; expected one of {Q_GROUP_SIZES}")


def quantizable(path: str, module: nn.Module, *, group_size: int) -> bool:
    """Linear / Embedding layers whose input dim splits into groups (norms have no to_quantized)."""
    return hasattr(module, "to_quantized") and module.weight.shape[-1] % group_size == 0


def quant_predicate(
    model: nn.Module, *, group_size: int, keep: tuple[str, ...] = ()
) -> Callable[[str, nn.Module], bool | dict]:
    """mlx-lm's choice of layers to quantize: `quantizable` ones, minus those the model's family keeps
    in source precision (its `quant_predicate`, as mlx-lm's model of the family declares it) and the
    modules under the `keep` prefixes. A layer the family gives its own parameters gets that dict."""
    family = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if any(path == k or path.startswith(k + ".") for k in keep):
            return False
        if not quantizable(path, module, group_size=group_size):
            return False
        choice = True if family is None else family(path, module)
        # mlx-lm's models may give a layer its own {"group_size", "bits"} (e.g. MoE routers at 8 bits)
        return choice if isinstance(choice, dict) else bool(choice)

    return predicate


def check_draft_quantize(bits: Optional[int]) -> None:
    """`draft_quantize`: None follows the target's `quantize`, 0 keeps the draft in float, else 4 or 8."""
    if bits is not None and bits != 0 and bits not in Q_BITS:
        raise ValueError(
            f"draft_quantize {bits!r} is not supported; expected 0 (keep the draft in float), "
            f"{' or '.join(map(str, Q_BITS))} bits, or none to follow quantize"
        )
