"""GGUF tensors into MLX arrays under our names.

Tensor types:
- F32, F16 as stored; BF16 exactly (the raw 16-bit patterns reinterpreted as bfloat16; `mx.load`
  would cast them to float16).
- Q8_0, Q4_0, Q4_1 stay quantized as MLX affine quantization with group size 32 and exactly the same
  values: Q8_0 `w = d*q` becomes `d*(q+128) - 128*d`, Q4_0 `w = d*(q-8)` becomes `d*q - 8*d`, Q4_1
  `w = d*q + m` is already affine. Scales and biases are float16, the precision of the blocks' own `d`.
- Every other type `gguf.quants` dequantizes (the K-quants Q2_K..Q6_K, Q5_0/Q5_1, IQ*, ...) is
  dequantized by it (llama.cpp's own code) and then, by default (`kquant="requantize"`), stored as
  MLX affine quantization with group size 32: 4 bits for sources of at most 4.5 bits per weight
  (Q4_K, IQ4, Q3_K, Q2_K), 8 bits for the wider ones (Q5_K, Q6_K, Q5_0/1). Why by default: the user
  chose a quantized file for its memory and speed; a bfloat16 copy would take 3.5x the memory of a
  Q4_K_M file and run at bfloat16 speed, and no source grid is replaced by a coarser one. Q4_K and
  Q5_K are affine per 32-weight sub-block (`d*sc*q - dmin*m`), so they keep their own grid (exact up
  to the float16 rounding of scale and bias); the others (16-weight sub-blocks, non-linear grids) are
  re-quantized with `mx.quantize` (within one MLX step). `kquant="bfloat16"` / `"float32"` keep the
  dequantized values instead (float32: exactly `gguf.quants.dequantize`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from mlx_dspark.loading.gguf_layout import SEPARATE_QKV
from mlx_dspark.loading.gguf_metadata import Metadata

KQUANT_MODES = ("requantize", "bfloat16", "float32")
GROUP_SIZE = 32  # ggml's block of 32 weights (Q8_0, Q4_0, Q4_1 and the K-quants' sub-blocks)
_DEQUANT_ROWS = 4096  # rows dequantized at once, to bound the float32 temporaries


@dataclass
class Tensor:
    weight: mx.array
    scales: Optional[mx.array] = None
    biases: Optional[mx.array] = None
    bits: Optional[int] = None
    ggml_type: str = ""

    def dequantized(self) -> mx.array:
        if self.scales is None:
            return self.weight.astype(mx.float32)
        return mx.dequantize(self.weight, self.scales.astype(mx.float32), self.biases.astype(mx.float32), group_size=GROUP_SIZE, bits=self.bits)


def read_weights(
    meta: Metadata, names: dict[str, str], *, kquant: str, dequantize_only: tuple[str, ...]
) -> tuple[dict[str, mx.array], dict[str, str]]:
    weights: dict[str, mx.array] = {}
    types: dict[str, str] = {}
    fused: dict[str, list[Tensor]] = {}
    for gguf_name, ours in names.items():
        t = meta.tensors[gguf_name]
        keep_float = gguf_name.split(".")[0] in dequantize_only  # the draft's copies of target tensors
        tensor = read_tensor(meta, t, kquant="float32" if keep_float else kquant)
        if keep_float and tensor.scales is not None:
            tensor = Tensor(tensor.dequantized(), ggml_type=tensor.ggml_type)
        if "#" in ours:
            stem, rest = ours.split("#")  # "<q_k_v_proj>#<part>.weight"
            index, suffix = rest.split(".", 1)
            fused.setdefault(f"{stem}.{suffix}", [None] * len(SEPARATE_QKV))[int(index)] = tensor  # type: ignore[list-item]
            continue
        _put(weights, types, ours, tensor)
    for name, parts in fused.items():
        _put(weights, types, name, _concat_rows(parts))
    return dict(sorted(weights.items())), types


def _put(weights: dict[str, mx.array], types: dict[str, str], name: str, tensor: Tensor) -> None:
    weights[name] = tensor.weight
    types[name] = tensor.ggml_type
    if tensor.scales is not None:
        prefix = name.removesuffix(".weight")
        weights[f"{prefix}.scales"] = tensor.scales
        weights[f"{prefix}.biases"] = tensor.biases


def _concat_rows(parts: list[Tensor]) -> Tensor:
    """Q, K, V stored separately, fused as q_k_v_proj (rows Q, then K, then V)."""
    kind = "+".join(p.ggml_type for p in parts)
    if all(p.scales is None for p in parts):
        dtypes = {p.weight.dtype for p in parts}
        dtype = dtypes.pop() if len(dtypes) == 1 else mx.float32
        return Tensor(mx.concatenate([p.weight.astype(dtype) for p in parts]), ggml_type=kind)
    if all(p.scales is not None and p.bits == parts[0].bits for p in parts):
        return Tensor(
            *(mx.concatenate([getattr(p, a) for p in parts]) for a in ("weight", "scales", "biases")),
            bits=parts[0].bits,
            ggml_type=kind,
        )
    # mixed storage: quantize the fused rows at the widest of the parts' widths
    bits = max(p.bits or 8 for p in parts)
    w, s, b = mx.quantize(mx.concatenate([p.dequantized() for p in parts]), group_size=GROUP_SIZE, bits=bits)
    return Tensor(w, s.astype(mx.float16), b.astype(mx.float16), bits=bits, ggml_type=kind)


def read_tensor(meta: Metadata, t: Any, *, kquant: str) -> Tensor:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    kind = T(t.tensor_type)
    data = t.data  # numpy view on the memory map
    if kind in (T.F32, T.F16):
        return Tensor(mx.array(np.ascontiguousarray(data)), ggml_type=kind.name)
    if kind == T.BF16:
        bits16 = np.ascontiguousarray(data).view(np.uint16)  # the raw bfloat16 patterns
        return Tensor(mx.array(bits16).view(mx.bfloat16), ggml_type=kind.name)
    shape = meta.shape(t.name)
    if len(shape) != 2:
        raise ValueError(f"{meta.path}: tensor {t.name!r} is {kind.name} with shape {shape}; only 2-D quantized tensors are supported")
    rows, cols = shape
    if kind in (T.Q8_0, T.Q4_0, T.Q4_1):
        return _affine_blocks(np.asarray(data).reshape(rows, cols // GROUP_SIZE, -1), kind.name)
    block, type_size = GGML_QUANT_SIZES.get(kind, (None, None))
    if block is None or kind in (T.I8, T.I16, T.I32, T.I64, T.F64):
        raise ValueError(f"{meta.path}: tensor {t.name!r} has type {kind.name}, which is not supported")
    from gguf.quants import dequantize

    bits = 4 if type_size * 8 / block <= 4.5 else 8
    chunks = []
    for start in range(0, rows, _DEQUANT_ROWS):
        try:
            values = mx.array(dequantize(np.asarray(data[start : start + _DEQUANT_ROWS]), kind))  # (r, cols) float32
        except NotImplementedError as e:
            raise ValueError(f"{meta.path}: tensor {t.name!r} has type {kind.name}, which gguf cannot dequantize") from e
        if kquant == "requantize":
            if cols % GROUP_SIZE:
                raise ValueError(f"{meta.path}: tensor {t.name!r} ({kind.name}) has {cols} columns, not a multiple of {GROUP_SIZE}")
            if kind in (T.Q4_K, T.Q5_K):
                part = _kquant_affine(np.asarray(data[start : start + _DEQUANT_ROWS]), values, bits=bits)
            else:
                w, s, b = mx.quantize(values, group_size=GROUP_SIZE, bits=bits)
                part = (w, s.astype(mx.float16), b.astype(mx.float16))
        else:
            part = (values.astype(mx.bfloat16) if kquant == "bfloat16" else values,)
        mx.eval(part)  # frees the float32 chunk before the next one
        chunks.append(part)
    arrays = [mx.concatenate(list(c)) if len(chunks) > 1 else c[0] for c in zip(*chunks)]
    if kquant == "requantize":
        return Tensor(*arrays, bits=bits, ggml_type=kind.name)
    return Tensor(arrays[0], ggml_type=kind.name)


def _kquant_affine(raw: np.ndarray, values: mx.array, *, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Q4_K / Q5_K rows as MLX affine quantization on their own grid: each 32-weight sub-block is
    `d*sc*q - dmin*m` (q < 16 / 32), so scale `d*sc` and bias `-dmin*m` reproduce it (up to the float16
    rounding of scale and bias), where re-quantizing the values would move them to another grid."""
    from gguf.quants import Q4_K

    rows, cols = values.shape
    blocks = raw.reshape(rows, cols // 256, -1)  # both start with d, dmin (float16) and 12 scale bytes
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).astype(np.float32)  # (rows, n, 1)
    dmin = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    scale = (d * sc.reshape(rows, -1, 8).astype(np.float32)).reshape(rows, -1)  # (rows, cols / 32)
    bias = -(dmin * m.reshape(rows, -1, 8).astype(np.float32)).reshape(rows, -1)
    grouped = np.array(values).reshape(rows, -1, GROUP_SIZE)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint((grouped - bias[..., None]) / scale[..., None])
    q = np.where(scale[..., None] == 0, 0, q).clip(0, (1 << bits) - 1).astype(np.uint8)
    packed = _pack(q.reshape(rows, -1), bits)
    return mx.array(packed), mx.array(scale.astype(np.float16)), mx.array(bias.astype(np.float16))


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned 4/8-bit values (rows, cols) in MLX's packing: uint32 words, first value in the low bits."""
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return np.ascontiguousarray(q).view(np.uint32)


def _affine_blocks(blocks: np.ndarray, kind: str) -> Tensor:
    """ggml blocks of 32 (rows, n_blocks, bytes) as MLX affine quantization with identical values."""
    rows, n_blocks, _ = blocks.shape
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]  # (rows, n_blocks)
    if kind == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)  # (rows, n_blocks, 32)
        packed = _pack((q.astype(np.int16) + 128).astype(np.uint8).reshape(rows, -1), 8)
        bias = -128.0 * d.astype(np.float32)
        bits = 8
    else:
        if kind == "Q4_0":
            qs, bias, bits = blocks[..., 2:], -8.0 * d.astype(np.float32), 4
        else:  # Q4_1: d, then the block's minimum m
            m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
            qs, bias, bits = blocks[..., 4:], m.astype(np.float32), 4
        # ggml: byte j holds weight j (low nibble) and weight j + 16 (high nibble)
        weights = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (rows, n_blocks, 32) in weight order
        packed = _pack(weights.reshape(rows, -1), 4)
    scales = d.astype(np.float32)
    dtype = np.float16 if np.all(np.abs(bias) <= np.finfo(np.float16).max) else np.float32  # -128*d may overflow
    return Tensor(
        mx.array(packed), mx.array(scales.astype(dtype)), mx.array(bias.astype(dtype)), bits=bits, ggml_type=kind
    )


def quantization_block(weights: dict[str, mx.array]) -> dict[str, Any]:
    """The config's `quantization` block as mlx-lm writes it: the commonest setting at the top, the
    modules quantized otherwise as per-module entries."""
    settings = {}
    for name in weights:
        if name.endswith(".scales"):
            module = name.removesuffix(".scales")
            bits = weights[f"{module}.weight"].shape[-1] * 32 // (weights[name].shape[-1] * GROUP_SIZE)
            settings[module] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    if not settings:
        return {}
    common = Counter(s["bits"] for s in settings.values()).most_common(1)[0][0]
    block: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common, "mode": "affine"}
    block.update({m: s for m, s in sorted(settings.items()) if s["bits"] != common})
    return block
