"""Each draft head's loader, one module per head named as in `models/heads/` (found by name through
`models.heads.HEADS`). A loader declares `DESCRIPTION` (what a user calls such a file) and `detect(config)`
(whether a checkpoint's config is one); a head read from a draft file of its own also gives `build(checkpoint,
*, target, target_source, dtype, options)` (options that do not apply to it refused by name) and `quantize(module,
*, bits, group_size)`. A head read from the target's own checkpoint (`FROM_TARGET = True`) gives
`build_from_target(checkpoint, *, dtype)` instead. Imports models/, never engine/."""

from __future__ import annotations

import importlib
from types import ModuleType

from mlx_dspark.models.heads import HEADS, head_module_name

FALLBACK = "draft"  # a file no head detects is read as a block draft (whose loader says what is missing)


def head_loader(head: str) -> ModuleType:
    """The loader module of `head` (loading/heads/<module>.py)."""
    return importlib.import_module(f"mlx_dspark.loading.heads.{head_module_name(head)}")


def file_heads() -> list[str]:
    """The heads read from draft files of their own, in registry order."""
    return [name for name in HEADS if not getattr(head_loader(name), "FROM_TARGET", False)]


def target_heads() -> list[str]:
    """The heads read from the target's own checkpoint (named in `draft=` by their name, e.g. "mtp")."""
    return [name for name in HEADS if getattr(head_loader(name), "FROM_TARGET", False)]


def detect_head(config: dict) -> str:
    """The head a draft file's config is: the first whose `detect` says so (the block draft's last)."""
    names = sorted(file_heads(), key=lambda name: name == FALLBACK)
    return next((name for name in names if head_loader(name).detect(config)), FALLBACK)
