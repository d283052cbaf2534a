"""Token-frequency rankings for a reduced draft vocabulary (FR-Spec): build, write, find and read them.

`rank_vocabulary` counts the tokens of text files under the target's tokenizer and ranks every id of
the target's vocabulary, most frequent first (ties and unseen ids by id), into a `vocab_rank.json`:

    {"format": "mlx_dspark.vocab_rank", "version": 1, "vocab_size": V, "tokens_counted": N,
     "source": {"model": ..., "files": [...]}, "ranked_ids": [V ids], "counts": [V counts]}

`read_ranked_ids(file, size=K, vocab_size=V)` gives its first K ids; a file named `vocab_rank.json`
beside the draft is found without being named (`find_rank_file`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from mlx_dspark.loading.checkpoint import read_checkpoint, resolve_path
from mlx_dspark.loading.tokenizer import load_tokenizer

RANK_FORMAT = "mlx_dspark.vocab_rank"
RANK_FILE = "vocab_rank.json"  # the name found beside a draft
CHUNK_CHARS = 1 << 20  # encode long files in pieces: bounded memory, about the same counts


def count_tokens(encode: Callable[[str], Sequence[int]], files: Sequence[Path], *, vocab_size: int) -> np.ndarray:
    """Token counts (V,) int64 of the files' text (UTF-8, undecodable bytes replaced)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in files:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        for start in range(0, len(text), CHUNK_CHARS):
            ids = np.asarray(encode(text[start : start + CHUNK_CHARS]), dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"{path}: the tokenizer produced ids outside the target's vocabulary [0, {vocab_size})")
            counts += np.bincount(ids, minlength=vocab_size)
    return counts


def ranking(counts: np.ndarray) -> dict[str, Any]:
    """Every id, most frequent first; equal counts (and unseen ids) in id order."""
    order = np.argsort(-counts, kind="stable")
    return {
        "format": RANK_FORMAT,
        "version": 1,
        "vocab_size": int(counts.shape[0]),
        "tokens_counted": int(counts.sum()),
        "ranked_ids": order.tolist(),
        "counts": counts[order].tolist(),
    }


def rank_vocabulary(model: str | Path, files: Sequence[str | Path], *, out: str | Path) -> dict[str, Any]:
    """Rank the target's vocabulary by the token frequencies of `files`; writes `out`, returns its content."""
    paths = [Path(f).expanduser() for f in files]
    if not paths:
        raise ValueError("give at least one --data file to count tokens in")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"data file(s) not found: {', '.join(missing)}")
    target_path = resolve_path(model, role="target")
    checkpoint = read_checkpoint(target_path, role="target")
    vocab_size = checkpoint.config.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"{checkpoint.config_source}: field 'vocab_size' must be a positive integer, got {vocab_size!r}")
    tokenizer = load_tokenizer(target_path, checkpoint.config, gguf_tokenizer=checkpoint.tokenizer)
    counts = count_tokens(lambda text: tokenizer.encode(text, add_special_tokens=False), paths, vocab_size=vocab_size)
    if counts.sum() == 0:
        raise ValueError(f"the data files hold no tokens: {', '.join(map(str, paths))}")
    result = ranking(counts)
    result["source"] = {"model": str(target_path), "files": [str(p) for p in paths]}
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result) + "\n", encoding="utf-8")
    return result


def find_rank_file(rank_file: str | Path | None, *, draft_path: Optional[Path]) -> Path:
    """The ranking to use: the one given, else `vocab_rank.json` beside the draft; else one error naming both ways."""
    if rank_file is not None:
        path = Path(rank_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"draft_vocab_file {path} not found")
        return path
    if draft_path is not None:
        directory = draft_path if draft_path.is_dir() else draft_path.parent
        path = directory / RANK_FILE
        if path.is_file():
            return path
    where = "beside the draft" if draft_path is None else f"in {draft_path if draft_path.is_dir() else draft_path.parent}"
    raise ValueError(
        f"draft_vocab (--draft-vocab) needs a token ranking: no {RANK_FILE} {where}; build one with "
        "`python -m mlx_dspark.rank_vocab --model TARGET --data FILE... --out RANK.json` and pass it as "
        "draft_vocab_file (--draft-vocab-file), or save it as " + RANK_FILE + " in the draft's directory"
    )


def read_ranked_ids(path: Path, *, size: int, vocab_size: int) -> list[int]:
    """The `size` most frequent ids of a ranking file, checked against the target's vocabulary size."""
    if not (isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= vocab_size):
        raise ValueError(f"draft_vocab must be an integer in [1, {vocab_size}] (the target's vocabulary size), got {size!r}")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable vocabulary ranking ({err})") from None
    if not isinstance(data, dict) or data.get("format") != RANK_FORMAT:
        raise ValueError(f"{path}: field 'format' must be {RANK_FORMAT!r} (written by python -m mlx_dspark.rank_vocab)")
    if data.get("vocab_size") != vocab_size:
        raise ValueError(
            f"{path}: field 'vocab_size' is {data.get('vocab_size')!r} but the target's vocabulary has {vocab_size} "
            "tokens: rank with this target's tokenizer"
        )
    ids = data.get("ranked_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: field 'ranked_ids' must be a list of token ids")
    if len(ids) < size:
        raise ValueError(f"{path}: field 'ranked_ids' holds {len(ids)} ids, fewer than draft_vocab {size}")
    head = ids[:size]
    bad = [i for i in head if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{path}: field 'ranked_ids' holds ids outside [0, {vocab_size}): {bad[:5]}")
    if len(set(head)) != len(head):
        raise ValueError(f"{path}: field 'ranked_ids' repeats token ids")
    return head
