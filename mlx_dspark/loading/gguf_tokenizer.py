"""The tokenizer a GGUF file describes (`tokenizer.ggml.*`), rebuilt as Hugging Face tokenizer files.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, the merges, each token's type
(control = a special added token, user-defined = a plain added token), the special ids, the chat
template and the name of a pre-tokenizer (`tokenizer.ggml.pre`) whose split regex lives in
llama.cpp's C++ code. `GGUFTokenizer.files()` writes the equivalent tokenizer.json (a byte-level
BPE, built with the `tokenizers` API), tokenizer_config.json, chat_template.jinja and
generation_config.json; `directory()` puts them in a cache directory named by the hash of their
content, which our loader then reads like any Hugging Face directory (mlx-lm's `load_tokenizer`).

Only byte-level BPE vocabularies (`tokenizer.ggml.model` "gpt2": GPT-2, Qwen, Llama 3, the Spark
models) with a known pre-tokenizer are built; anything else is a ValueError that names the value and
the fix (a tokenizer.json beside the GGUF file).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# llama.cpp token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Qwen3.5's: marks (\p{M}) join letters
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The Spark tokenizer (tokenizer.ggml.pre "spark2_5"): four splits in this order, as llama-vocab.cpp
# lists them for LLAMA_VOCAB_PRE_TYPE_SPARK2_5 (a DeepSeek-V3-like sequence whose third split keeps a
# lone CR or LF apart, plus a last split of every digit).
SPARK2_5_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+""",
    r"\p{N}",
)
# tokenizer.ggml.pre -> (split regexes applied in order, BPE ignore_merges), as the Hugging Face
# tokenizer.json of those models has them; () = the GPT-2 regex built into the ByteLevel pre-tokenizer.
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "gpt-2": ((), False),
    "qwen2": ((QWEN2_SPLIT,), False),
    "deepseek-r1-qwen": ((QWEN2_SPLIT,), False),
    "qwen35": ((QWEN35_SPLIT,), False),
    "llama3": ((LLAMA3_SPLIT,), True),
    "llama-v3": ((LLAMA3_SPLIT,), True),
    "llama-bpe": ((LLAMA3_SPLIT,), True),
    "spark2_5": (SPARK2_5_SPLITS, False),
}


@dataclass(frozen=True)
class GGUFTokenizer:
    source: Path
    model: str  # tokenizer.ggml.model
    pre: Optional[str]  # tokenizer.ggml.pre
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int]  # bos / eos / pad / unk / eot / eom / mask, as far as the file sets them
    add_bos: bool
    add_eos: bool
    chat_template: Optional[str]

    @classmethod
    def from_metadata(cls, meta: Any) -> Optional["GGUFTokenizer"]:
        """The tokenizer material of a GGUF (`gguf_metadata.Metadata`); None without tokenizer keys."""
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            return None
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ValueError(f"{meta.path}: key 'tokenizer.ggml.tokens' is missing or empty (tokenizer.ggml.model is {model!r})")
        types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(f"{meta.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        ids = {}
        for name in ("bos", "eos", "padding", "unknown", "eot", "eom", "mask"):
            value = meta.get(f"tokenizer.ggml.{name}_token_id")
            if value is not None:
                if not 0 <= value < len(tokens):
                    raise ValueError(f"{meta.path}: tokenizer.ggml.{name}_token_id {value} is outside the {len(tokens)} tokens")
                ids[{"padding": "pad", "unknown": "unk"}.get(name, name)] = value
        template = meta.get("tokenizer.chat_template")
        return cls(
            source=meta.path,
            model=model,
            pre=meta.get("tokenizer.ggml.pre"),
            tokens=tokens,
            token_types=[int(t) for t in types],
            merges=meta.get("tokenizer.ggml.merges") or [],
            special_ids=ids,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=template if isinstance(template, str) else None,
        )

    @property
    def eos_token_ids(self) -> list[int]:
        """Generation stops at eos, and at end-of-turn / end-of-message when the file names them."""
        return list(dict.fromkeys(self.special_ids[k] for k in ("eos", "eot", "eom") if k in self.special_ids))

    def build(self):
        """The `tokenizers.Tokenizer` (byte-level BPE with the file's added tokens)."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

        fix = "put the model's tokenizer.json beside the GGUF file (or use its Hugging Face directory)"
        if self.model != "gpt2":
            raise ValueError(
                f"{self.source}: tokenizer.ggml.model {self.model!r} is not supported (only byte-level BPE, 'gpt2'); {fix}"
            )
        if self.pre not in PRE_TOKENIZERS:
            raise ValueError(
                f"{self.source}: tokenizer.ggml.pre {self.pre!r} is not a known pre-tokenizer "
                f"(supported: {sorted(PRE_TOKENIZERS)}); {fix}"
            )
        splits, ignore_merges = PRE_TOKENIZERS[self.pre]
        vocab: dict[str, int] = {}
        for i, (token, kind) in enumerate(zip(self.tokens, self.token_types)):
            if kind == UNUSED:
                continue  # llama.cpp's "[PAD<i>]" placeholders for ids the tokenizer does not use
            if token in vocab:
                raise ValueError(f"{self.source}: token {token!r} appears twice in tokenizer.ggml.tokens (ids {vocab[token]} and {i})")
            vocab[token] = i
        merges = []
        for m in self.merges:
            pair = m.split(" ")
            if len(pair) != 2:
                raise ValueError(f"{self.source}: tokenizer.ggml.merges entry {m!r} is not two tokens separated by a space")
            merges.append((pair[0], pair[1]))
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
        if not splits:
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False) for split in splits]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
            )
        tokenizer.decoder = decoders.ByteLevel()
        added = [(i, t, k) for i, (t, k) in enumerate(zip(self.tokens, self.token_types)) if k in (CONTROL, USER_DEFINED)]
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t, k in added if k == CONTROL])
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for _, t, k in added if k == USER_DEFINED])
        if self.add_bos or self.add_eos:
            single, pair, specials = "$A:0", "$A:0 $B:1", []
            for flag, key, before in ((self.add_bos, "bos", True), (self.add_eos, "eos", False)):
                if not flag:
                    continue
                if key not in self.special_ids:
                    raise ValueError(f"{self.source}: tokenizer.ggml.add_{key}_token is true but tokenizer.ggml.{key}_token_id is missing")
                tok = self.tokens[self.special_ids[key]]
                specials.append((tok, self.special_ids[key]))
                single = f"{tok}:0 {single}" if before else f"{single} {tok}:0"
                pair = f"{tok}:0 $A:0 {tok}:1 $B:1" if before else f"$A:0 {tok}:0 $B:1 {tok}:1"
            tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
        return tokenizer

    def files(self) -> dict[str, str]:
        """File name -> text of the Hugging Face tokenizer files."""
        tokenizer = self.build()

        def token(key: str) -> Optional[str]:
            return self.tokens[self.special_ids[key]] if key in self.special_ids else None

        added_decoder = {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": k == CONTROL,
            }
            for i, (t, k) in enumerate(zip(self.tokens, self.token_types))
            if k in (CONTROL, USER_DEFINED)
        }
        config: dict[str, Any] = {
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "added_tokens_decoder": added_decoder,
            "bos_token": token("bos"),
            # llama.cpp never cleans up spaces when detokenizing
            "clean_up_tokenization_spaces": False,
            "eos_token": token("eos"),
            "pad_token": token("pad"),
            "unk_token": token("unk"),
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        if "mask" in self.special_ids:
            config["mask_token"] = token("mask")
        files = {"tokenizer.json": tokenizer.to_str(pretty=True)}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
            files["chat_template.jinja"] = self.chat_template
        files["tokenizer_config.json"] = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        generation: dict[str, Any] = {"eos_token_id": self.eos_token_ids}
        for key in ("bos", "pad"):
            if key in self.special_ids:
                generation[f"{key}_token_id"] = self.special_ids[key]
        files["generation_config.json"] = json.dumps(generation, indent=2) + "\n"
        return files

    def directory(self, cache_root: Optional[Path] = None) -> Path:
        """A directory holding `files()`, under `cache_root` (default: $XDG_CACHE_HOME or ~/.cache,
        then mlx_dspark/gguf-tokenizers), named by the hash of the files, written once."""
        files = self.files()
        digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode("utf-8")).hexdigest()[:24]
        if cache_root is None:
            cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx_dspark" / "gguf-tokenizers"
        target = Path(cache_root) / digest
        if target.is_dir():
            return target
        tmp = Path(cache_root) / f".{digest}.{os.getpid()}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        try:
            tmp.rename(target)
        except OSError:  # another process wrote the same directory first
            if not target.is_dir():
                raise
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
        return target
