"""Non-finite weights and logits: NaN or Inf in a checkpoint gives fluent nonsense (one token repeated,
a perfect acceptance rate), so they are refused with the tensor's name or the step instead.

The weight check runs on the device: one `isfinite(...).all()` reduction per floating tensor, the
flags read back in batches; the weights themselves never come to the host. Packed quantized weights
are integers and cannot hold NaN; their floating `scales` and `biases` are checked.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

_ELEMENTS_PER_READ = 1 << 28  # flags read back after this many checked elements, bounding the temporaries
_NAMES_SHOWN = 8


class NonFiniteError(ValueError):
    """The model's weights or logits hold NaN or Inf: a broken checkpoint, not a bad request."""


def nonfinite_parameters(module: nn.Module) -> list[str]:
    """Names of the module's floating parameters that hold a NaN or an Inf, in parameter order."""
    bad: list[str] = []
    names: list[str] = []
    flags: list[mx.array] = []
    elements = 0

    def read() -> None:
        if flags:
            finite = mx.stack(flags).tolist()  # the one host read of the batch: one bool per tensor
            bad.extend(name for name, ok in zip(names, finite) if not ok)
            names.clear()
            flags.clear()

    for name, value in tree_flatten(module.parameters()):
        if not mx.issubdtype(value.dtype, mx.floating):
            continue
        names.append(name)
        flags.append(mx.isfinite(value).all())
        elements += value.size
        if elements >= _ELEMENTS_PER_READ:
            read()
            elements = 0
    read()
    return bad


def check_finite_weights(module: nn.Module, *, what: str) -> None:
    """Raise NonFiniteError naming the tensors of `module` (the `what`, e.g. "target") with NaN or Inf."""
    bad = nonfinite_parameters(module)
    if not bad:
        return
    shown = ", ".join(bad[:_NAMES_SHOWN]) + (f" and {len(bad) - _NAMES_SHOWN} more" if len(bad) > _NAMES_SHOWN else "")
    raise NonFiniteError(
        f"the {what}'s weights hold NaN or Inf in {len(bad)} tensor(s): {shown}; the checkpoint is damaged "
        "or was converted to a dtype too narrow for its values (download or convert it again)"
    )


def check_finite_logits(logits: mx.array, *, step: str) -> None:
    """Raise NonFiniteError when `logits` hold NaN or Inf (one reduction and one host read)."""
    if not mx.isfinite(logits).all().item():
        raise NonFiniteError(
            f"the target's logits at {step} hold NaN or Inf: its weights are damaged or overflow in this "
            "dtype (mlx_dspark.models.target.finite.check_finite_weights names the tensors)"
        )
