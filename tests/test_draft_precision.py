"""The draft's own precision (draft_quantize / draft_dtype / --draft-q-bits), quantized target KV
caches (kv_bits), and the generate CLI's cost report (target forwards, --compare).

Every lever keeps the round lossless against the target it runs with: greedy speculative output is
plain greedy decoding's. Quantized KV caches change that target itself (its attention reads rounded
keys and values), so there the reference is plain decoding with the same quantized caches.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.cache import QuantizedKVCache as MlxLmQuantizedKVCache
from typer.testing import CliRunner

import mlx_dspark
from mlx_dspark.cli.generate import app as generate_app
from mlx_dspark.loading.convert import convert
from mlx_dspark.loading.load import load
from mlx_dspark.loading.precision import DRAFT_SOURCE_PRECISION
from mlx_dspark.models.caches.kv import trim_caches

PROMPT = [5, 17, 42, 99, 300, 7, 11, 200, 3, 64, 128, 250]


def _greedy(pair, *, speculative=True, max_tokens=32):
    return mlx_dspark.generate(pair, PROMPT, max_tokens=max_tokens, speculative=speculative).tokens


def _quantized_paths(model) -> set[str]:
    return {path for path, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}


@pytest.mark.parametrize("bits", [4, 8])
def test_draft_quantize_quantizes_only_the_drafts_layers(tiny_spark_pair, bits):
    target, draft = tiny_spark_pair
    pair = load(target, draft, draft_quantize=bits)
    quantized = _quantized_paths(pair.draft)
    assert "fc" in quantized and any(p.startswith("layers.0.") for p in quantized)
    assert all(m.bits == bits for _, m in pair.draft.named_modules() if isinstance(m, nn.QuantizedLinear))
    assert not any(p == k or p.startswith(k + ".") for p in quantized for k in DRAFT_SOURCE_PRECISION[bits])
    # measured: an 8-bit Markov head costs nothing, a 4-bit one does (where its rank splits into groups)
    markov_embedding = "markov_head.markov_w1"
    assert (markov_embedding in quantized) == (bits == 8 and pair.draft.args.markov_rank % 64 == 0)
    assert not _quantized_paths(pair.target)  # the target keeps its precision
    assert _greedy(pair) == _greedy(load(target), speculative=False)


def test_a_quantized_target_with_a_float_draft(tiny_qwen3_pair):
    target, draft = tiny_qwen3_pair
    pair = load(target, draft, quantize=4, draft_quantize=0)
    assert _quantized_paths(pair.target) and not _quantized_paths(pair.draft)
    follows = load(target, draft, quantize=4)  # without draft_quantize the draft follows quantize
    assert "fc" in _quantized_paths(follows.draft)
    assert _greedy(pair) == _greedy(pair, speculative=False)


def test_draft_dtype_casts_the_draft_only(tiny_qwen3_pair):
    target, draft = tiny_qwen3_pair
    pair = load(target, draft, draft_dtype="bfloat16")
    assert {v.dtype for _, v in tree_flatten(pair.draft.parameters())} == {mx.bfloat16}
    assert {v.dtype for _, v in tree_flatten(pair.target.parameters())} == {mx.float32}
    assert _greedy(pair) == _greedy(load(target), speculative=False)


def test_bad_draft_precision_options_are_clear_errors(tiny_qwen3_pair):
    target, draft = tiny_qwen3_pair
    with pytest.raises(ValueError, match="draft_quantize 3 is not supported"):
        load(target, draft, draft_quantize=3)
    with pytest.raises(ValueError, match="draft_quantize only applies with a draft"):
        load(target, draft_quantize=4)
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        load(target, draft, draft_dtype="int8")
    with pytest.raises(ValueError, match="kv_bits 2 is not supported"):
        load(target, kv_bits=2)


@pytest.mark.parametrize("bits", [4, 8])
def test_convert_draft_q_bits_equals_load_time_draft_quantize(tiny_spark_pair, tmp_path, bits):
    target, draft = tiny_spark_pair
    out = convert(draft, tmp_path / "d", draft_q_bits=bits, log=lambda _: None)
    converted = load(target, out)
    at_load = load(target, draft, draft_quantize=bits)
    a, b = dict(tree_flatten(converted.draft.parameters())), dict(tree_flatten(at_load.draft.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)
    assert not _quantized_paths(converted.target)
    with pytest.raises(ValueError, match="applies to a DSpark draft; this is a target"):
        convert(target, tmp_path / "t4", draft_q_bits=4, log=lambda _: None)
    with pytest.raises(ValueError, match="not both"):
        convert(draft, tmp_path / "x", quantize=True, draft_q_bits=4, log=lambda _: None)


@pytest.mark.parametrize("bits", [4, 8])
def test_kv_bits_quantizes_the_full_attention_caches_and_stays_lossless(tiny_spark_pair, bits):
    target, draft = tiny_spark_pair
    pair = load(target, draft, kv_bits=bits)
    caches = pair.target.make_cache()
    kinds = {layer_type: type(c) for layer_type, c in zip(pair.target.layer_types, caches)}
    assert kinds["sliding_attention"] is RotatingKVCache and issubclass(kinds["full_attention"], MlxLmQuantizedKVCache)
    assert all(c.bits == bits for c in caches if isinstance(c, MlxLmQuantizedKVCache))
    spec = _greedy(pair, max_tokens=40)
    assert spec == _greedy(pair, speculative=False, max_tokens=40)  # the same (quantized-cache) target
    float_tokens = _greedy(load(target), speculative=False, max_tokens=40)
    if bits == 8:  # 8-bit caches follow the float target closely on this tiny model (not a guarantee)
        assert spec[:8] == float_tokens[:8]


def test_a_quantized_cache_rolls_back(tiny_qwen3_target):
    pair = load(tiny_qwen3_target, kv_bits=8)
    caches = pair.target.make_cache()
    tokens = mx.array([PROMPT])
    logits_a, _ = pair.target(tokens[:, :8], cache=caches)
    pair.target(tokens[:, 8:], cache=caches)
    trim_caches(caches, 4)  # back to 8 positions
    assert all(c.offset == 8 for c in caches)
    again, _ = pair.target(tokens[:, 8:], cache=caches)
    fresh = pair.target.make_cache()
    pair.target(tokens[:, :8], cache=fresh)
    reference, _ = pair.target(tokens[:, 8:], cache=fresh)
    np.testing.assert_array_equal(np.array(again), np.array(reference))
    assert not any(isinstance(c, KVCache) for c in caches)


def test_generate_reports_target_forwards_and_compares_with_plain_decoding(tiny_spark_pair):
    target, draft = tiny_spark_pair
    common = ["--model", str(target), "--draft", str(draft), "--prompt", "Hello there", "--max-tokens", "16", "--compare"]
    result = CliRunner().invoke(generate_app, common)
    assert result.exit_code == 0, result.output
    assert "target forwards for 16 tokens" in result.stderr
    assert "compare: plain" in result.stderr and "outputs identical: yes" in result.stderr
    data = CliRunner().invoke(generate_app, [*common, "--json", "--draft-quantize", "8"])
    assert data.exit_code == 0, data.output
    report = json.loads(data.stdout.strip().splitlines()[-1])
    assert report["plain"]["identical"] is True and report["plain"]["target_forwards"] == 16
    assert 1 <= report["target_forwards"] <= 16 and report["target_forwards"] == len(report["acceptance_lengths"]) + 1


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--draft-quantize", "3"], "--draft-quantize must be 0"),
        (["--draft-vocab-file", "r.json"], "--draft-vocab-file needs --draft-vocab"),
        (["--kv-bits", "2"], "--kv-bits must be one of 4, 8"),
        (["--draft-dtype", "int8"], "--draft-dtype must be one of"),
    ],
)
def test_bad_precision_flags_are_one_error_line(tiny_spark_pair, extra, message):
    target, draft = tiny_spark_pair
    result = CliRunner().invoke(generate_app, ["--model", str(target), "--draft", str(draft), "--max-tokens", "4", *extra])
    assert result.exit_code == 2 and message in result.stderr, result.output


@pytest.mark.parametrize("bits", [4, 8])
def test_the_markov_head_is_quantized_at_8_bits_and_kept_at_4(bits):
    """On the demo draft (Markov rank 64, which splits into groups): the measured choice of DRAFT_SOURCE_PRECISION."""
    from mlx_dspark.cli.common import demo_pair

    demo = demo_pair()
    pair = load(demo.target, demo.draft, dtype="float32", draft_quantize=bits)
    quantized = _quantized_paths(pair.draft)
    assert ("markov_head.markov_w2" in quantized) == (bits == 8)
    assert ("markov_head.markov_w1" in quantized) == (bits == 8)
    assert "confidence_head.proj" not in quantized and "layers.0.mlp.up_proj" in quantized


def test_a_prompt_cache_with_quantized_caches_reports_its_size(tiny_spark_pair):
    target, draft = tiny_spark_pair
    pair = load(target, draft, kv_bits=8)
    prompt_cache = mlx_dspark.make_prompt_cache(pair)
    assert prompt_cache.nbytes == 0  # before any prefill (mlx-lm's own cache raises here)
    first = mlx_dspark.generate(pair, PROMPT, max_tokens=12, prompt_cache=prompt_cache)
    assert prompt_cache.nbytes > 0
    again = mlx_dspark.generate(pair, PROMPT + first.tokens[:-1], max_tokens=6, prompt_cache=prompt_cache)
    assert again.cached_tokens > 0
    assert again.tokens == mlx_dspark.generate(pair, PROMPT + first.tokens[:-1], max_tokens=6, speculative=False).tokens


def test_the_server_checks_the_precision_flags_at_startup():
    from mlx_dspark.cli.server import app as server_app

    result = CliRunner().invoke(server_app, ["--port", "0", "--kv-bits", "3"])
    assert result.exit_code == 2 and "--kv-bits must be one of 4, 8" in result.stderr, result.output
    result = CliRunner().invoke(server_app, ["--port", "0", "--draft-vocab-file", "r.json"])
    assert result.exit_code == 2 and "--draft-vocab-file needs --draft-vocab" in result.stderr, result.output
