"""Training data for a DSpark draft: text files and .jsonl records, tokenized into chunks with a loss mask.

Sources (files, or directories read recursively in sorted order, hidden entries skipped):
- any non-.jsonl file: UTF-8 text, every token trained on;
- `.jsonl`, one JSON object a line, one of
  `{"text": ...}` (every token), `{"prompt": ..., "completion": ...}` (the completion and the end-of-sequence
  token only; no end-of-sequence token with `"finished": false`, as `train.regenerate` marks a
  continuation cut at its token limit), `{"messages": [{"role", "content"}, ...]}` (rendered with the
  target's chat template; the assistant turns only).

A document is cut into chunks of at most `seq_len` tokens. `Batches` picks the chunks of step `s`
from a permutation seeded by (seed, epoch), so a run resumed at step `s` sees exactly the batches
the uninterrupted run would have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np


@dataclass
class Chunk:
    tokens: list[int]
    loss_mask: list[bool]  # True where the token is a training target (and may be an anchor)


@dataclass
class Batch:
    tokens: np.ndarray  # (B, S) int32, padded at the end
    loss_mask: np.ndarray  # (B, S) bool, False on padding


def source_files(paths: Sequence[str | Path]) -> list[Path]:
    """Files named directly, plus the files under directories (recursive, sorted, no hidden entries)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not found:
                raise ValueError(f"data directory {path} holds no files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"data path {path} does not exist")
    return files


def _encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special))


def _chat_spans(tokenizer: Any, messages: list[dict], *, where: str) -> tuple[list[int], list[bool]]:
    """Tokens of the rendered conversation and a mask over its assistant turns.

    Each assistant turn is located by rendering the conversation up to it (with the generation prompt)
    and through it: this needs a template whose renders of a prefix are prefixes of the whole.
    """
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: message {i} needs 'role' and 'content' keys")

    def render(items: list[dict], *, generation_prompt: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(items, add_generation_prompt=generation_prompt, tokenize=True))

    tokens = render(messages, generation_prompt=False)
    mask = [False] * len(tokens)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], generation_prompt=True) if i else []
        through = render(messages[: i + 1], generation_prompt=False)
        if through[: len(before)] != before or tokens[: len(through)] != through:
            raise ValueError(
                f"{where}: the chat template does not render message {i} as an extension of the messages before it, "
                "so the assistant tokens cannot be located; use prompt/completion records instead"
            )
        for j in range(len(before), len(through)):
            mask[j] = True
    if not any(mask):
        raise ValueError(f"{where}: the conversation has no assistant message to train on")
    return tokens, mask


def _record(tokenizer: Any, record: Any, *, where: str) -> tuple[list[int], list[bool]]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if isinstance(record.get("messages"), list):
        return _chat_spans(tokenizer, record["messages"], where=where)
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        prompt = _encode(tokenizer, record["prompt"], special=True)
        completion = _encode(tokenizer, record["completion"], special=False)
        eos = tokenizer.eos_token_id
        if eos is not None and record.get("finished", True) is not False:  # regenerated text cut at max_tokens: no eos
            completion.append(int(eos))
        return prompt + completion, [False] * len(prompt) + [True] * len(completion)
    if isinstance(record.get("text"), str):
        tokens = _encode(tokenizer, record["text"], special=True)
        return tokens, [True] * len(tokens)
    raise ValueError(
        f"{where}: a record needs 'text', 'prompt' and 'completion', or 'messages'; got keys {sorted(record)}"
    )


def read_text(path: Path) -> str:
    """A source file's text; ValueError naming the file when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from err


def jsonl_records(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    """(`file:line`, record) for each non-blank line of a JSONL file's text; ValueError naming the line."""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: invalid JSON ({err.msg})") from err
        yield where, record


def documents(paths: Sequence[str | Path], tokenizer: Any) -> Iterator[tuple[list[int], list[bool]]]:
    """(tokens, loss mask) of every document of the sources, in order."""
    for path in source_files(paths):
        text = read_text(path)
        if path.suffix != ".jsonl":
            if text.strip():
                tokens = _encode(tokenizer, text, special=True)
                yield tokens, [True] * len(tokens)
            continue
        for where, record in jsonl_records(path, text):
            yield _record(tokenizer, record, where=where)


def chunk_documents(docs: Iterator[tuple[list[int], list[bool]]], *, seq_len: int) -> list[Chunk]:
    """Cut documents into chunks of at most seq_len tokens; keep those with at least one anchor."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    chunks = []
    for tokens, mask in docs:
        for start in range(0, len(tokens), seq_len):
            piece, piece_mask = tokens[start : start + seq_len], mask[start : start + seq_len]
            if any(a and b for a, b in zip(piece_mask, piece_mask[1:])):
                chunks.append(Chunk(piece, piece_mask))
    return chunks


def load_chunks(paths: Sequence[str | Path], tokenizer: Any, *, seq_len: int) -> list[Chunk]:
    chunks = chunk_documents(documents(paths, tokenizer), seq_len=seq_len)
    if not chunks:
        raise ValueError(f"no training chunks in {[str(p) for p in paths]}: every document is too short or has no trainable tokens")
    return chunks


def collate(chunks: Sequence[Chunk], *, pad_id: int) -> Batch:
    """Pad at the end (the target is causal, so padding never changes the positions before it)."""
    length = max(len(c.tokens) for c in chunks)
    tokens = np.full((len(chunks), length), pad_id, dtype=np.int32)
    mask = np.zeros((len(chunks), length), dtype=bool)
    for i, chunk in enumerate(chunks):
        tokens[i, : len(chunk.tokens)] = chunk.tokens
        mask[i, : len(chunk.loss_mask)] = chunk.loss_mask
    return Batch(tokens, mask)


class Batches:
    """The batch of any step, a pure function of (seed, step): epochs are seeded permutations."""

    def __init__(self, chunks: list[Chunk], *, batch_size: int, seed: int, pad_id: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.chunks = chunks
        self.batch_size = min(batch_size, len(chunks))
        self.seed = seed
        self.pad_id = pad_id
        self.steps_per_epoch = len(chunks) // self.batch_size
        self._epoch = -1
        self._order: np.ndarray | None = None

    def picks(self, step: int) -> np.ndarray:
        """The chunk indices of step `step`'s global batch, in order."""
        epoch, index = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.chunks))
            self._epoch = epoch
        assert self._order is not None
        return self._order[index * self.batch_size : (index + 1) * self.batch_size]

    def __call__(self, step: int, share: slice = slice(None)) -> Batch:
        """The batch of `step`, or the `share` of its sequences one data-parallel rank computes."""
        return collate([self.chunks[i] for i in self.picks(step)[share]], pad_id=self.pad_id)


def sequential_batches(chunks: list[Chunk], *, batch_size: int, pad_id: int) -> Iterator[Batch]:
    """Every chunk once, in order (evaluation and calibration)."""
    for start in range(0, len(chunks), batch_size):
        yield collate(chunks[start : start + batch_size], pad_id=pad_id)
