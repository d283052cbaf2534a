"""The tokenizer rebuilt from a GGUF's tokenizer.ggml.* keys encodes, decodes and renders the chat
template exactly as the tokenizer.json it was converted from (the tiny byte-level BPE tokenizers of
both families, and a Qwen2-style pre-tokenizer variant)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from mlx_dspark.loading.gguf_checkpoint import read_gguf
from mlx_dspark.loading.gguf_metadata import Metadata
from mlx_dspark.loading.gguf_tokenizer import QWEN2_SPLIT, GGUFTokenizer
from mlx_dspark.loading.tokenizer import load_tokenizer
from mlx_dspark.testing.gguf_writer import write_gguf_target

_PIECES = [
    "The quick brown fox jumps over the lazy dog. I'm sure we'll see THEY'RE here; it's 12345678 o'clock.\n",
    "Café naïve façade Ångström Straße œuvre déjà-vu — “quotes” and ‘single’ … ¿Qué? ¡Sí!\n",
    "你好，世界。日本語のテキストと한국어 텍스트。数学：∑∫√∞≈≠ 中文标点「引号」\n",
    "Emoji: 🙂👍🏽🚀🇫🇷 👨‍👩‍👧‍👦 ✨\u200b zero-width and \u00a0nbsp\n",
    "def add(a, b):\n    return a + b  # comment\n\tif x >= 10 and y != 0: print(f\"{x:>8}\")\n",
    "   leading spaces,\ttabs,\r\nwindows lines\n\n\nand trailing   \n",
    "<think>reasoning</think> then <|mask|> and <|User|>hi<|Bot|>hello<｜end▁of▁sentence｜><|im_start|>user\n",
    "numbers 3.14159 -42 1e-6 0x1F 2024-01-01 100% $5.00 #tag @user a_b-c.d/e\\f\n",
]
MIXED = "".join(_PIECES) * 5  # about 2,600 characters


@pytest.fixture(scope="module", params=["spark2_5", "qwen3"])
def pair(request, tmp_path_factory) -> tuple[Path, GGUFTokenizer]:
    source = request.getfixturevalue(f"tiny_{'spark' if request.param == 'spark2_5' else 'qwen3'}_target")
    path = write_gguf_target(source, tmp_path_factory.mktemp("tok") / "t.gguf")
    return source, read_gguf(path).tokenizer


def _same_encodings(reference: Tokenizer, rebuilt: Tokenizer, text: str) -> None:
    assert len(text) > 2000
    for special in (True, False):
        expected = reference.encode(text, add_special_tokens=special).ids
        assert rebuilt.encode(text, add_special_tokens=special).ids == expected
    for piece in _PIECES:
        assert rebuilt.encode(piece).ids == reference.encode(piece).ids, piece
    ids = reference.encode(text).ids
    for skip in (True, False):
        assert rebuilt.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    every_id = list(range(reference.get_vocab_size()))
    assert rebuilt.decode(every_id, skip_special_tokens=False) == reference.decode(every_id, skip_special_tokens=False)
    assert rebuilt.get_vocab() == reference.get_vocab()


def test_gguf_tokenizer_encodes_and_decodes_as_tokenizer_json(pair):
    source, gguf_tokenizer = pair
    _same_encodings(Tokenizer.from_file(str(source / "tokenizer.json")), gguf_tokenizer.build(), MIXED)


def test_gguf_tokenizer_directory_loads_like_the_hf_directory_with_the_chat_template(pair, tmp_path):
    source, gguf_tokenizer = pair
    directory = gguf_tokenizer.directory(cache_root=tmp_path)
    assert gguf_tokenizer.directory(cache_root=tmp_path) == directory  # content-addressed, written once
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    reference, rebuilt = load_tokenizer(source, config), load_tokenizer(directory, {})
    assert rebuilt.encode(MIXED) == reference.encode(MIXED)
    ids = reference.encode(MIXED)
    assert rebuilt.decode(ids) == reference.decode(ids)
    messages = [
        {"role": "system", "content": "Be brief. Ünïcödé 你好 🙂"},
        {"role": "user", "content": MIXED[:500]},
        {"role": "assistant", "content": "Sure: <think>x</think> done."},
        {"role": "user", "content": "And now?"},
    ]
    for tokenize in (False, True):
        expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize)
        assert rebuilt.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize) == expected
    assert rebuilt.eos_token == reference.eos_token
    # a GGUF always names a bos id (Qwen's tokenizer_config has bos_token null; its config.json has one)
    assert reference.bos_token in (None, rebuilt.bos_token)
    assert config["eos_token_id"] in rebuilt.eos_token_ids
    # streaming detokenization as the generators use it
    detok = rebuilt.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == reference.decode(ids)


def test_qwen2_pre_tokenizer_gguf_matches_tokenizer_json(tiny_qwen3_target, tmp_path):
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert QWEN2_SPLIT == PRETOKENIZE_REGEX  # our copy of the regex is Qwen2's own
    source = tmp_path / "qwen2-style"
    shutil.copytree(tiny_qwen3_target, source)
    tok = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    tok["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ],
    }
    (source / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    gguf_tokenizer = read_gguf(write_gguf_target(source, tmp_path / "t.gguf")).tokenizer
    assert gguf_tokenizer.pre == "qwen2"
    reference = Tokenizer.from_file(str(source / "tokenizer.json"))
    _same_encodings(reference, gguf_tokenizer.build(), MIXED)
    # the split differs from GPT-2's on these: the rebuilt tokenizer really follows the file's pre type
    gpt2 = Tokenizer.from_file(str(tiny_qwen3_target / "tokenizer.json"))
    assert gpt2.encode(MIXED).ids != reference.encode(MIXED).ids


def test_unknown_pre_tokenizer_or_model_is_one_clear_error(tiny_qwen3_target, tmp_path):
    path = write_gguf_target(tiny_qwen3_target, tmp_path / "t.gguf")
    tokenizer = read_gguf(path).tokenizer
    from dataclasses import replace

    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre 'deepseek-v3' is not a known pre-tokenizer.*tokenizer.json beside") as e:
        replace(tokenizer, pre="deepseek-v3").build()
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model 'llama' is not supported"):
        replace(tokenizer, model="llama").build()


def test_gguf_without_tokenizer_keys_has_no_tokenizer(tiny_qwen3_target, tmp_path):
    path = write_gguf_target(tiny_qwen3_target, tmp_path / "t.gguf", tokenizer=False)
    assert GGUFTokenizer.from_metadata(Metadata.open(path)) is None
    assert read_gguf(path).tokenizer is None
