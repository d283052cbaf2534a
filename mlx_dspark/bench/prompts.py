"""Benchmark prompt sets: the built-in ones and `NAME=FILE.jsonl` files in the common dataset layouts.

Every prompt becomes a list of chat messages ending with a user turn. A jsonl line may carry its text
as `prompt`, `question` or `problem` (one user message), `turns` (MT-Bench / Arena-Hard: a list of
strings or of `{"content": ...}` objects; the first turn is used, since later turns need the model's
own answers) or `messages` (role/content objects; a trailing assistant reference answer is dropped).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mlx_dspark.bench.builtin_prompts import BUILTIN

TEXT_FIELDS = ("prompt", "question", "problem")
LAYOUTS = TEXT_FIELDS + ("turns", "messages")


@dataclass(frozen=True)
class BenchPrompt:
    category: str  # display name of the dataset row, e.g. "GSM8K"
    index: int  # position in its set
    messages: tuple[dict, ...]  # chat messages, ending with a user turn

    @property
    def text(self) -> str:
        """The last user message, for tokenizers without a chat template."""
        return self.messages[-1]["content"]


def builtin_names() -> list[str]:
    return list(BUILTIN)


def builtin_prompts(name: str, *, limit: int | None = None) -> list[BenchPrompt]:
    if name not in BUILTIN:
        raise ValueError(f"unknown built-in dataset {name!r}; expected one of {builtin_names()} or NAME=FILE.jsonl")
    display, texts = BUILTIN[name]
    texts = texts[:limit] if limit else texts
    return [BenchPrompt(display, i, ({"role": "user", "content": t},)) for i, t in enumerate(texts)]


def _user(text: Any, *, where: str, field: str) -> tuple[dict, ...]:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: field {field!r} must be a non-empty string, got {text!r:.60}")
    return ({"role": "user", "content": text},)


def messages_from_record(record: Any, *, where: str) -> tuple[dict, ...]:
    """The chat messages of one jsonl record; ValueError naming `where` (file:line) when malformed."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for field in TEXT_FIELDS:
        if field in record:
            return _user(record[field], where=where, field=field)
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: field 'turns' must be a non-empty list")
        first = turns[0]
        if isinstance(first, dict):
            if "content" not in first:
                raise ValueError(f"{where}: turns[0] must be a string or an object with 'content', got keys {sorted(first)}")
            first = first["content"]
        return _user(first, where=where, field="turns[0]")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: field 'messages' must be a non-empty list")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise ValueError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]  # a reference answer, not part of the prompt
        if not messages or messages[-1]["role"] != "user":
            raise ValueError(f"{where}: 'messages' must end with a user message (after dropping assistant answers)")
        return tuple({"role": m["role"], "content": m["content"]} for m in messages)
    raise ValueError(f"{where}: no prompt field; expected one of {list(LAYOUTS)}, got keys {sorted(record)}")


def load_jsonl(name: str, path: str | Path, *, limit: int | None = None) -> list[BenchPrompt]:
    """Prompts of a jsonl file (blank lines skipped); the first malformed line is a ValueError with its number."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--dataset {name}={path}: no such file")
    prompts: list[BenchPrompt] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            prompts.append(BenchPrompt(name, len(prompts), messages_from_record(record, where=where)))
            if limit and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"{path}: no prompts (the file is empty)")
    return prompts


def parse_dataset_option(option: str) -> tuple[str, Path]:
    """`NAME=FILE.jsonl` -> (NAME, path)."""
    name, sep, file = option.partition("=")
    if not sep or not name.strip() or not file.strip():
        raise ValueError(f"--dataset expects NAME=FILE.jsonl, got {option!r}")
    return name.strip(), Path(file.strip())


def select_prompts(
    *, datasets: Sequence[str], files: Sequence[str], limit: int | None
) -> list[BenchPrompt]:
    """Built-in sets named in `datasets` (all when empty and no files), then the `NAME=FILE` files."""
    names = list(datasets) or ([] if files else builtin_names())
    prompts: list[BenchPrompt] = []
    for name in names:
        prompts.extend(builtin_prompts(name, limit=limit))
    for option in files:
        name, path = parse_dataset_option(option)
        prompts.extend(load_jsonl(name, path, limit=limit))
    return prompts
