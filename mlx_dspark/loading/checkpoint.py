"""Checkpoint files: locating a directory (local or Hugging Face), config.json, safetensors shards.

`read_checkpoint(path)` is the one reading entry point: it returns a `Checkpoint` (config dict, lazy
weights under the checkpoint's names, the file each came from), the form `load.build_target` /
`load.build_draft` take, whatever the files were: a `.gguf` file goes to `gguf_checkpoint.read_gguf`,
which returns the same form (plus the tokenizer material, storage types and compute dtype of the file).
Safetensors reading is lazy (`mx.load` maps tensors without reading their data) and every problem with the files
is a `ValueError` / `FileNotFoundError` naming the file. Writing goes shard by shard
(`ShardWriter`), so a converter never holds more than one output shard in memory.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx

INDEX_FILE = "model.safetensors.index.json"
# Files fetched from the Hub: weights, configs, tokenizer; never checkpoint code (*.py).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model", "*.tiktoken"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# one file of a Hub repo: "owner/name:path/in/repo/FILE.gguf"
_REPO_FILE = re.compile(r"^([A-Za-z0-9][\w.-]*/[\w.-]+):([^:]+\.gguf)$", re.IGNORECASE)
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
MAX_SHARD_BYTES = 5 << 30  # as mlx-lm: ~5 GB per output file

_SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


@dataclass
class Checkpoint:
    """What a model is built from, independent of the file format."""

    config: dict[str, Any]  # the config.json layout (HF / DeepSpec; an MLX `quantization` block if quantized)
    weights: dict[str, mx.array]  # name -> array, named as the equivalent safetensors checkpoint names them
    origin: dict[str, str]  # name -> the file it came from (for messages)
    path: Path  # the checkpoint directory or file (for messages)
    config_source: str  # where the config was read from (for messages naming a field)
    # GGUF only: the tokenizer of its `tokenizer.ggml.*` keys (a gguf_tokenizer.GGUFTokenizer, or None)
    tokenizer: Any = None
    # GGUF only: tensor name -> the GGUF type it was stored as ("BF16", "Q8_0", ...), for the shared-tensor check
    storage: dict[str, str] = field(default_factory=dict)
    # the compute dtype when the user gives none (None: the weights as stored); see `gguf_compute_dtype`
    default_dtype: Optional[mx.Dtype] = None


def read_checkpoint(path: Path, *, role: Optional[str] = None, tap_ids: Optional[Sequence[int]] = None) -> Checkpoint:
    """A safetensors checkpoint directory (HF or MLX layout, sharded or not, read lazily) or a GGUF file.

    role ("target" / "draft") and tap_ids (a draft's tapped target layers as Hugging Face layer ids,
    replacing the file's `target_layers`) apply to GGUF files, which say in their metadata what they
    are; a safetensors draft's taps are replaced by `load.build_draft(tap_ids=)`."""
    if is_gguf(path):
        return _read_gguf_checkpoint(path, role=role, tap_ids=tap_ids)
    directory = path
    config = read_config(directory)
    weights, origin = load_weights(directory)
    return Checkpoint(
        config=config,
        weights=weights,
        origin={name: path.name for name, path in origin.items()},
        path=directory,
        config_source=str(directory / "config.json"),
    )


def resolve_path(path_or_repo: str | Path, *, role: str = "model") -> Path:
    """A checkpoint directory, or a GGUF file, local or from the Hugging Face Hub.

    Accepted: a local directory (returned as is); a local `.gguf` file; a directory holding exactly one
    `.gguf` and no config.json (the GGUF file is returned); a repo id (`owner/name`, downloaded with
    `snapshot_download`); a single GGUF file of a repo as `owner/name:FILE.gguf` (only that file is
    downloaded, with `hf_hub_download`). FileNotFoundError naming the path and the fix otherwise.
    """
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if path.is_dir():
            return _single_gguf(path, role=role) or path
        if path.suffix.lower() == ".gguf":
            return path
        raise FileNotFoundError(f"{role} path {path} is a file; expected a checkpoint directory or a .gguf file")
    name = str(path_or_repo)
    single = _REPO_FILE.match(name)
    if single:
        return _download_file(single.group(1), single.group(2), role=role)
    if not _REPO_ID.match(name):
        raise FileNotFoundError(f"{role} directory {path} does not exist")
    return _download(name, role=role)


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def _read_gguf_checkpoint(path: Path, *, role: Optional[str], tap_ids: Optional[Sequence[int]]) -> Checkpoint:
    from mlx_dspark.loading.gguf_checkpoint import read_gguf

    ck = read_gguf(path, role=role, tap_ids=None if tap_ids is None else list(tap_ids))
    return Checkpoint(
        config=ck.config,
        weights=ck.weights,
        origin=dict.fromkeys(ck.weights, path.name),
        path=path,
        config_source=str(path),  # the config is the file's metadata
        tokenizer=ck.tokenizer,
        storage=dict(ck.tensor_types),
        default_dtype=gguf_compute_dtype(ck.config, ck.weights),
    )


def gguf_compute_dtype(config: dict[str, Any], weights: dict[str, mx.array]) -> mx.Dtype:
    """The dtype a GGUF model computes in when the user gives none.

    GGUF keeps 1-D tensors (norms) in F32 beside BF16 / F16 matrices; computing in the matrices' dtype
    gives the same model as the Hugging Face checkpoint in that dtype (the norms were that dtype's values
    before conversion). A quantized file (MLX scales and biases in float16) computes in bfloat16: its
    scales are rounded to bfloat16 (a relative change of at most 2**-9 per group, well below the
    quantization step), because float16 activations can overflow on real models and float16 scales
    with bfloat16 activations would promote everything to float32. dtype="float32" computes with the
    file's values exactly, dtype="float16" keeps the float16 scales exact.
    """
    if "quantization" in config:
        return mx.bfloat16
    kinds = {v.dtype for k, v in weights.items() if v.ndim >= 2 and mx.issubdtype(v.dtype, mx.floating)}
    return kinds.pop() if len(kinds) == 1 else mx.float32  # mixed matrix types: the one that holds them all


def _single_gguf(directory: Path, *, role: str) -> Path | None:
    """The GGUF file of a directory without config.json that holds GGUF files (None otherwise)."""
    if (directory / "config.json").is_file():
        return None
    ggufs = sorted(directory.glob("*.gguf"))
    if not ggufs:
        return None
    if len(ggufs) > 1:
        raise FileNotFoundError(
            f"{role} directory {directory} holds several GGUF files ({[g.name for g in ggufs]}) and no config.json; "
            "pass the one to load as the path"
        )
    if _SPLIT_GGUF.search(ggufs[0].name):
        raise FileNotFoundError(f"{ggufs[0]}: a split GGUF (one part of several) is not supported; merge it first (llama-gguf-split --merge)")
    return ggufs[0]


def _download(repo_id: str, *, role: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        raise FileNotFoundError(
            f"{role} {repo_id!r} is not a local directory and could not be downloaded from the Hugging Face Hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Check the repo id, your network "
            "and HF_HUB_OFFLINE / HF_TOKEN, or download it first and pass the local directory."
        ) from e


def _download_file(repo_id: str, filename: str, *, role: str) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, filename))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        raise FileNotFoundError(
            f"{role} {repo_id}:{filename}: the file {filename!r} of the Hugging Face repo {repo_id!r} is not in the "
            f"local cache and could not be downloaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            "Check the repo id and file name, your network and HF_HUB_OFFLINE / HF_TOKEN, or download the file "
            "first and pass its local path."
        ) from e


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no config.json; expected a Hugging Face or MLX checkpoint directory")
    return read_json(path)


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those listed by model.safetensors.index.json (each must
    exist), else every *.safetensors in the directory."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: field 'weight_map' is missing or empty")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} lists shard(s) {missing} that are not in {directory}")
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weight files (and no {INDEX_FILE})")
    return files


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (safetensors dtype, shape) from a file's header, checking that the file holds
    every tensor's bytes (a truncated download is caught here, before any data is read)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes; truncated or corrupt)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise ValueError(f"{path}: safetensors header claims {header_len} bytes but the file has {size} (truncated or corrupt)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: unreadable safetensors header (corrupt file): {e}") from e
    data_size = size - 8 - header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from e
        if end > data_size:
            raise ValueError(
                f"{path}: tensor {name!r} ends at byte {end} of the data but the file holds {data_size} "
                "(truncated download or corrupt file)"
            )
        itemsize = _SAFETENSORS_DTYPE_BYTES.get(dtype)
        count = 1
        for d in shape:
            count *= d
        if itemsize is not None and end - begin != count * itemsize:
            raise ValueError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape} {dtype} (corrupt file)")
        out[name] = (dtype, shape)
    return out


def load_file(path: Path) -> dict[str, mx.array]:
    """Lazily load one safetensors file, after checking its header."""
    read_header(path)
    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read as safetensors ({e})") from e


def load_weights(directory: Path) -> tuple[dict[str, mx.array], dict[str, Path]]:
    """All tensors of a checkpoint (lazy) and the file each came from; the index (when present) must
    name exactly the tensors in its shards."""
    weights: dict[str, mx.array] = {}
    origin: dict[str, Path] = {}
    for path in weight_files(directory):
        for name, array in load_file(path).items():
            if name in weights:
                raise ValueError(f"{path}: tensor {name!r} is also in {origin[name]}")
            weights[name] = array
            origin[name] = path
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path)["weight_map"]
        listed_missing = sorted(set(weight_map) - set(weights))
        if listed_missing:
            raise ValueError(f"{index_path} lists tensor(s) {listed_missing[:8]} that are in none of its shards")
        wrong = sorted(k for k, f in weight_map.items() if origin[k].name != f)
        if wrong:
            raise ValueError(f"{index_path}: tensor(s) {wrong[:8]} are not in the shard the index names")
    return weights, origin


@dataclass
class ShardWriter:
    """Writes tensors into shards of at most `max_bytes` as they come, then names them
    `model-0000i-of-0000N.safetensors` (or `model.safetensors` alone) with an index."""

    directory: Path
    max_bytes: int = MAX_SHARD_BYTES
    _pending: dict[str, mx.array] = field(default_factory=dict)
    _pending_bytes: int = 0
    _written: list[tuple[Path, list[str]]] = field(default_factory=list)
    total_bytes: int = 0

    def add(self, name: str, array: mx.array) -> None:
        if self._pending and self._pending_bytes + array.nbytes > self.max_bytes:
            self.flush()
        self._pending[name] = array
        self._pending_bytes += array.nbytes
        self.total_bytes += array.nbytes

    def flush(self) -> None:
        if not self._pending:
            return
        path = self.directory / f".shard-{len(self._written):05d}.tmp.safetensors"
        mx.eval(list(self._pending.values()))
        mx.save_safetensors(str(path), self._pending, metadata={"format": "mlx"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> list[Path]:
        """Flush, rename the shards to their final names, write the index; returns the shard paths."""
        self.flush()
        count = len(self._written)
        weight_map, final = {}, []
        for i, (tmp, names) in enumerate(self._written):
            name = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            tmp.rename(self.directory / name)
            final.append(self.directory / name)
            weight_map.update({n: name for n in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return final
