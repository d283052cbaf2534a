"""Every pre-tokenizer upstream writes for the families we serve (`spark2_5` for the Spark target,
`qwen2` / `qwen35` for Qwen targets) rebuilt from a GGUF tokenizes exactly as the Hugging Face
tokenizer the file was converted from, for a byte-level BPE with real merges (trained here with that
pre-tokenizer, so the split decides which merges apply), over mixed text with CJK, kana, digit runs,
punctuation and backslash runs, code, whitespace runs, CR/LF and special tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from mlx_dspark.loading.gguf_metadata import Metadata
from mlx_dspark.loading.gguf_tokenizer import PRE_TOKENIZERS, GGUFTokenizer
from mlx_dspark.testing.gguf_writer import add_tokenizer

_EDGES = [
    "1234567890 12 123 1234 3.14159 ٣٤٥ ⅧⅨ 2026-12-01T20:23:35Z 0x7fff 1e-9\n",
    "日本語のテキスト、カタカナとひらがな。中文汉字混合English单词和123数字。龥龦 〜ー\n",
    "!!!??? ...... ------====== \\\\\\\\ \\n\\t ''' ``` \"\"\" (((x))) {[<>]} a+b*c/d%e\n",
    "def f(x):\r\n\treturn {'k': [x, x**2]}  # comment\r\n\r\n\n\n   \t  \n",
    "Ünïcödé ñ é (e\u0301) Straße Ελληνικά русский עברית العربية हिन्दी\n",
    "<|User|>hi there<|Bot|><think>ok</think>answer<｜end▁of▁sentence｜>\n",
    "   leading and trailing   \n\n\n  \r\r\n x\u3000y\u00a0z 🙂👍🏽 'll 's 'RE\n",
]
TEXT = "".join(_EDGES) * 6  # about 2,900 characters

_SPECIALS = ["<｜start▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<|System|>", "<|User|>", "<|Bot|>", "<|mask|>"]
_PLAIN_ADDED = ["<think>", "</think>"]


def _hf_pre_tokenizer(pre: str):
    splits, _ = PRE_TOKENIZERS[pre]
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated", invert=False) for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]
    )


def _train(pre: str) -> Tokenizer:
    """A byte-level BPE trained with the pre-tokenizer `pre` (as its model's tokenizer.json has it)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _hf_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [TEXT[i : i + 200] for i in range(0, len(TEXT), 97)] * 3
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens(_PLAIN_ADDED)
    return tok


def _hf_dir(tmp_path: Path, pre: str) -> Path:
    directory = tmp_path / f"hf-{pre}"
    directory.mkdir()
    tok = _train(pre)
    tok.save(str(directory / "tokenizer.json"))
    vocab = tok.get_vocab()
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": False, "mask_token": "<|mask|>", "tokenizer_class": "PreTrainedTokenizerFast"}),
        encoding="utf-8",
    )
    config = {"bos_token_id": vocab[_SPECIALS[0]], "eos_token_id": vocab[_SPECIALS[1]]}
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def _gguf_tokenizer(directory: Path, path: Path) -> GGUFTokenizer:
    """A tokenizer-only GGUF written as upstream's converter writes the `tokenizer.ggml.*` keys."""
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "spark2_5")
    add_tokenizer(writer, directory)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFTokenizer.from_metadata(Metadata.open(path))


@pytest.mark.parametrize("pre", ["spark2_5", "qwen35", "qwen2"])
def test_gguf_pre_tokenizer_with_real_merges_matches_the_hf_tokenizer(pre, tmp_path):
    directory = _hf_dir(tmp_path, pre)
    reference = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert len(json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"]) > 200
    gguf_tokenizer = _gguf_tokenizer(directory, tmp_path / "t.gguf")
    assert gguf_tokenizer.pre == pre
    rebuilt = gguf_tokenizer.build()
    assert len(TEXT) > 2000
    assert rebuilt.encode(TEXT).ids == reference.encode(TEXT).ids
    for piece in _EDGES:
        assert rebuilt.encode(piece).ids == reference.encode(piece).ids, piece
    ids = reference.encode(TEXT).ids
    assert rebuilt.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False) == TEXT
    assert rebuilt.get_vocab() == reference.get_vocab()


def test_spark2_5_split_is_what_decides_the_ids(tmp_path):
    """The same vocabulary and merges under another pre-tokenizer give other ids on this text, so the
    test above really checks the spark2_5 split (digits one by one, CJK runs, lone CR / LF)."""
    directory = _hf_dir(tmp_path, "spark2_5")
    reference = Tokenizer.from_file(str(directory / "tokenizer.json"))
    for other in ("qwen2", "gpt-2"):
        gguf_tokenizer = _gguf_tokenizer(directory, tmp_path / f"{other}.gguf")
        from dataclasses import replace

        assert replace(gguf_tokenizer, pre=other).build().encode(TEXT).ids != reference.encode(TEXT).ids
    spark = _gguf_tokenizer(directory, tmp_path / "s.gguf").build()
    pieces = [spark.decode([i]) for i in spark.encode("x 2026\r\n\r\n日本語").ids]
    assert "2026" not in pieces and "\r\n" not in pieces
    assert [p for p in pieces if p.isdigit()] == ["2", "0", "2", "6"]


def test_spark2_5_gguf_target_tokenizes_from_its_own_metadata(tiny_spark_target, tmp_path):
    """A spark2_5 target GGUF whose tokenizer.ggml.pre is "spark2_5" loads its tokenizer from the file."""
    from mlx_dspark.loading.gguf_checkpoint import read_gguf
    from mlx_dspark.loading.tokenizer import load_tokenizer
    from mlx_dspark.testing.gguf_writer import write_gguf_target

    source = tmp_path / "spark"
    shutil.copytree(tiny_spark_target, source)
    tok = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    tok["pre_tokenizer"] = json.loads(_hf_pre_tokenizer("spark2_5").__getstate__())
    (source / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    gguf = read_gguf(write_gguf_target(source, tmp_path / "t.gguf"))
    assert gguf.tokenizer.pre == "spark2_5"
    rebuilt = load_tokenizer(gguf.tokenizer.directory(cache_root=tmp_path / "cache"), {})
    reference = Tokenizer.from_file(str(source / "tokenizer.json"))
    assert rebuilt.encode(TEXT, add_special_tokens=False) == reference.encode(TEXT, add_special_tokens=False).ids
