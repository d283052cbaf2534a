"""Each draft head's loader, one module per head named as in `models/heads/` (found by name through
`models.heads.HEADS`). A loader declares `DESCRIPTION` (what a user calls such a file) and `detect(config)`
(whether a checkpoint's config is one); a head read from a draft file of its own also gives `build(checkpoint,
*, target, target_source, dtype, options)` (options that do not apply to it refused by name) and `quantize(module,
*, bits, group_size)`. A head read from the target's own checkpoint (`FROM_TARGET = True`; `TAKES_ARG` when `NAME:ARG` means something)
gives `build_from_target(checkpoint, *, dtype)` instead, and `target_weights(config, weights)`: the target's tensors without its own. Imports models/, never engine/."""

from __future__ import annotations

import importlib
from types import ModuleType

from mlx_dspark.models.heads import HEADS, head_module_name

FALLBACK = "draft"  # a file no head detects is read as a block draft (whose loader says what is missing)
# what a loader may declare, and its default where it does not
FLAGS = {"FROM_TARGET": False, "TAKES_ARG": False, "GENERIC": False}
# load() options that shape a block draft's taps and vocabulary and mean nothing to a head of another kind
BLOCK_DRAFT_OPTIONS = ("draft_tap_ids", "draft_vocab", "draft_vocab_file")


def head_loader(head: str) -> ModuleType:
    """The loader module of `head` (loading/heads/<module>.py)."""
    return importlib.import_module(f"mlx_dspark.loading.heads.{head_module_name(head)}")


def declares(head: str, flag: str) -> bool:
    """A loader's flag (`FLAGS`: FROM_TARGET, TAKES_ARG, GENERIC), its default where the loader leaves it out."""
    return bool(vars(head_loader(head)).get(flag, FLAGS[flag]))


def refuse_block_options(options: dict, *, source: str, this: str) -> None:
    """Refuse, in one line, a block draft's option (`BLOCK_DRAFT_OPTIONS`) given with a head that is `this`."""
    for name in BLOCK_DRAFT_OPTIONS:
        if options.get(name) is not None:
            raise ValueError(f"{source}: {name} applies to DSpark drafts; this is {this}: drop it")


def file_heads() -> list[str]:
    """The heads read from draft files of their own, in registry order."""
    return [name for name in HEADS if not declares(name, "FROM_TARGET")]


def target_heads() -> list[str]:
    """The heads read from the target's own checkpoint (named in `draft=` by their name)."""
    return [name for name in HEADS if declares(name, "FROM_TARGET")]


def target_weights(config: dict, weights: dict) -> dict:
    """The target's own weights: the tensors of the heads read from its checkpoint left out (each loader's
    `target_weights`)."""
    for name in target_heads():
        weights = head_loader(name).target_weights(config, weights)
    return weights


def draft_help() -> str:
    """`--draft`'s help, one clause per registered head (each loader's HELP)."""
    files = "; ".join(head_loader(name).HELP for name in file_heads())
    own = "; ".join(f"'{name}': {head_loader(name).HELP}" for name in target_heads())
    return (
        f"Draft: local directory, Hugging Face repo id, FILE.gguf, or owner/name:FILE.gguf, told apart by its files: {files}; {own}; "
        "'auto': the published draft of a known --model (any quantization of it), else a head the target carries; several joined "
        "by commas, one of each kind ('DRAFT,EAGLE3', 'PATH,NAME'): each round proposes from the one that pays most on this machine; "
        "'lookup': no draft, prompt-lookup drafts alone."
    )


def generic(head: str) -> bool:
    """A head whose `detect` matches any model of a kind (`GENERIC = True`: a draft model, any causal LM): tried
    after the heads with keys of their own, and a target's config is never refused as one."""
    return declares(head, "GENERIC")


def detect_head(config: dict) -> str:
    """The head a draft file's config is: the first whose `detect` says so (the heads with keys of their own, the
    block draft's last of them, then the generic ones); else the block draft, whose loader says what is missing."""
    names = sorted(file_heads(), key=lambda name: (generic(name), name == FALLBACK))
    return next((name for name in names if head_loader(name).detect(config)), FALLBACK)
