"""Compare grammar engines for constrained decoding: llguidance, xgrammar, outlines-core.

For each vocabulary size (131072 = Spark, 151936 = Qwen3) a synthetic byte-level vocabulary is built
(256 byte tokens + frequent-looking pieces of a small corpus + random ASCII words); every engine gets the
same token byte strings. Measured on this CPU: the time to build the tokenizer view, to compile a JSON
Schema, the mean time of one next-token mask along a valid answer, and whether rollback works (consume
3 tokens, roll back 3, the next mask is the one before).

    python scripts/bench_grammar_engines.py [--vocab 131072 151936] [--engines llguidance xgrammar outlines]

xgrammar and outlines-core are not dependencies of mlx_dspark: install them to run their rows.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}
ANSWER = json.dumps(
    {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"],
     "address": {"street": "12 St James's Square", "city": "London"}, "active": True},
    separators=(",", ":"),
)  # fmt: skip
CORPUS = (ANSWER + ' {"name": "value", "items": [1, 2, 3]} the quick brown fox jumps over the lazy dog '
          "def add(a, b): return a + b\n for i in range(10): print(i)").encode()  # fmt: skip


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    vocab = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    for n in range(2, 9):  # every corpus piece of 2..8 bytes: real JSON tokens exist
        for i in range(len(CORPUS) - n):
            piece = CORPUS[i : i + n]
            if piece not in seen:
                seen.add(piece)
                vocab.append(piece)
    alphabet = b"abcdefghijklmnopqrstuvwxyz0123456789 _-.,:;\"'{}[]()\n"
    while len(vocab) < size - 1:
        piece = bytes(rng.choice(alphabet) for _ in range(rng.randint(2, 10)))
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    vocab.append(b"<eos>")  # the last id is end-of-sequence
    return vocab[:size]


def greedy_tokenize(text: bytes, vocab: list[bytes]) -> list[int]:
    index = {piece: i for i, piece in enumerate(vocab[:-1])}
    out, i = [], 0
    while i < len(text):
        for n in range(min(10, len(text) - i), 0, -1):
            if text[i : i + n] in index:
                out.append(index[text[i : i + n]])
                i += n
                break
    return out


def bench_llguidance(vocab: list[bytes], tokens: list[int]) -> dict:
    import llguidance
    from mlx_dspark.engine.logits.constraints import JSON_OPTIONS  # what mlx_dspark compiles with
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    start = time.perf_counter()
    # llguidance reads a Hugging Face tokenizer: byte-level BPE whose vocabulary is our byte strings
    table = _bytes_to_unicode()
    bpe = {"".join(table[b] for b in piece): i for i, piece in enumerate(vocab[:-1])}
    tok = Tokenizer(models.BPE(vocab=bpe, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=len(vocab), eos_token=len(vocab) - 1)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS), log_level=0)
    compile_s = time.perf_counter() - start
    assert not matcher.is_error(), matcher.get_error()
    mask = np.zeros(((len(vocab) + 31) // 32,), np.int32)
    times, excluded = [], 0
    for t in tokens:
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        times.append(time.perf_counter() - start)
        excluded += not (mask[t // 32] >> (t % 32)) & 1  # a legal token the mask leaves out
        assert matcher.consume_token(t), matcher.get_error()
    rollback_ok = _rollback_check_ll(matcher, tokens, mask)
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_us": _us(times), "rollback": rollback_ok,
            "answer_tokens_masked_out": excluded}


def _rollback_check_ll(matcher, tokens, mask) -> bool:
    matcher.reset()
    matcher.consume_tokens(tokens[:5])
    before = mask.copy()
    matcher.unsafe_compute_mask_ptr(before.ctypes.data, before.nbytes)
    matcher.consume_tokens(tokens[5:8])
    matcher.rollback(3)
    after = mask.copy()
    matcher.unsafe_compute_mask_ptr(after.ctypes.data, after.nbytes)
    return bool((before == after).all())


def bench_xgrammar(vocab: list[bytes], tokens: list[int]) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[len(vocab) - 1])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - start
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    times, excluded = [], 0
    for t in tokens:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - start)
        excluded += not (int(bitmask[0, t // 32]) >> (t % 32)) & 1
        assert matcher.accept_token(t), f"token {t} refused"
    matcher.reset()
    for t in tokens[:5]:
        matcher.accept_token(t)
    matcher.fill_next_token_bitmask(bitmask)
    before = bitmask.clone()
    for t in tokens[5:8]:
        matcher.accept_token(t)
    matcher.rollback(3)
    matcher.fill_next_token_bitmask(bitmask)
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_us": _us(times), "rollback": bool((before == bitmask).all()),
            "answer_tokens_masked_out": excluded}


def bench_outlines(vocab: list[bytes], tokens: list[int]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    table: dict[str, list[int]] = {}
    for i, piece in enumerate(vocab[:-1]):
        table.setdefault(piece.decode("latin-1"), []).append(i)  # outlines keys tokens by string
    vocabulary = Vocabulary(len(vocab) - 1, table)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=""), vocabulary)
    compile_s = time.perf_counter() - start
    guide = Guide(index, max_rollback=16)
    mask = np.zeros(((len(vocab) + 31) // 32,), np.int32)
    times = []
    for t in tokens:
        start = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
        times.append(time.perf_counter() - start)
        guide.advance(t)
    guide.reset()
    for t in tokens[:5]:
        guide.advance(t)
    before = mask.copy()
    guide.write_mask_into(before.ctypes.data, before.size, before.itemsize)
    for t in tokens[5:8]:
        guide.advance(t)
    guide.rollback_state(3)
    after = mask.copy()
    guide.write_mask_into(after.ctypes.data, after.size, after.itemsize)
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_us": _us(times), "rollback": bool((before == after).all())}


def _us(times: list[float]) -> str:
    return f"median {statistics.median(times) * 1e6:.0f}, mean {statistics.mean(times) * 1e6:.0f}, max {max(times) * 1e6:.0f}"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are written in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


ENGINES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines": bench_outlines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[131072, 151936])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    args = parser.parse_args()
    for size in args.vocab:
        vocab = synthetic_vocab(size)
        tokens = greedy_tokenize(ANSWER.encode(), vocab)
        print(f"vocab {size}: answer of {len(ANSWER)} bytes = {len(tokens)} tokens")
        for name in args.engines:
            try:
                row = ENGINES[name](vocab, tokens)
            except ImportError as err:
                row = {"error": f"not installed ({err})"}
            except Exception as err:  # a benchmark row that fails is reported, not fatal
                row = {"error": f"{type(err).__name__}: {err}"}
            print(f"  {name}: {row}", flush=True)


if __name__ == "__main__":
    main()
