"""What every rank of a split target must share, as short digests: the target's files and the versions
of the code that runs them. Ranks compare them at start (`models/split_target.agree`) and refuse to run
on different files: a follower with other weights of the same shapes would otherwise mix them silently.

Reading a large checkpoint whole at every start is not possible, so the weights' digest covers each
weights file's name, size and first and last MiB (the safetensors header and the tensors at both
ends; a GGUF's header and tensor table): different exports, quantizations and truncated copies differ
there; two checkpoints that differ only in the middle of a file are not told apart."""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")
ENDS = 1 << 20  # bytes read at each end of a weights file


def _digest(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.digest()


def _file_ends(path: Path) -> bytes:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(ENDS)
        f.seek(max(size - ENDS, 0))
        return _digest(path.name.encode(), str(size).encode(), head, f.read(ENDS))


def versions() -> str:
    """The versions of the packages a split forward runs: ours, MLX's, mlx-lm's."""
    found = []
    for name in ("mlx_dspark", "mlx", "mlx-lm"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} ?")
    return ", ".join(found)


def target_fingerprint(target_path: str | Path) -> dict[str, bytes]:
    """Digests by part ("versions", "config", "weights") of a target directory or single-file checkpoint."""
    path = Path(target_path)
    config = path / "config.json" if path.is_dir() else None
    files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES) if path.is_dir() else [path]
    return {
        "versions": _digest(versions().encode()),
        "config": _digest(config.read_bytes() if config is not None and config.is_file() else b""),
        "weights": _digest(*(_file_ends(p) for p in files)),
    }
