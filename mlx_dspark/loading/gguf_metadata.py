"""One GGUF file's key/values and tensor index (the `gguf` package's reader), with typed getters
whose errors name the file and the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

_REQUIRED = object()  # getters: no default, the key must be present


class Metadata:
    """The key/values and tensor index of one GGUF file, with typed getters whose errors name the
    file and the key."""

    def __init__(self, path: Path, reader: Any):
        self.path = path
        self.reader = reader
        self.tensors = {t.name: t for t in reader.tensors}
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{path}: key 'general.architecture' is missing; not a model GGUF")
        self.architecture = arch

    @classmethod
    def open(cls, path: Path) -> "Metadata":
        from gguf import GGUFReader

        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        size = path.stat().st_size
        try:
            reader = GGUFReader(path)
        except (ValueError, IndexError, KeyError, OverflowError) as e:
            # the reader indexes past the end of a truncated memmap, or meets garbage in a corrupt header
            raise ValueError(f"{path}: not a readable GGUF file ({size} bytes; truncated or corrupt): {e}") from e
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ValueError(
                    f"{path}: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes} but the file has {size} "
                    "(truncated download or corrupt file)"
                )
        return cls(path, reader)

    def get(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        return default if value is None else value

    def require(self, key: str, *, why: str = "") -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: key {key!r} is missing{' (' + why + ')' if why else ''}")
        return value

    def integer(self, key: str, default: Any = _REQUIRED, *, low: int = 0) -> Any:
        value = self.get(key)
        if value is None:
            return self.require(key) if default is _REQUIRED else default
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{self.path}: key {key!r} must be an integer >= {low}, got {value!r}")
        return value

    def number(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.get(key)
        if value is None:
            return self.require(key) if default is _REQUIRED else default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{self.path}: key {key!r} must be a number, got {value!r}")
        # GGUF floats are float32: the shortest decimal that reads back as the same float32 (1e-06)
        return float(str(np.float32(value))) if isinstance(value, float) else float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self.path}: key {key!r} must be a bool, got {value!r}")
        return value

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's logical shape in numpy order (GGUF stores the dims reversed)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def tensor_or_fail(self, name: str, why: str) -> tuple[int, ...]:
        if name not in self.tensors:
            raise ValueError(f"{self.path}: tensor {name!r} is missing ({why})")
        return self.shape(name)


# -- configs ---------------------------------------------------------------------------------------
