"""Lossless greedy decoding through the public API, with the real DSpark drafts of both families.

Random tiny drafts rarely agree with their target, so these runs mostly take the rejection path; the
accept-all and reject-at-k paths are covered with an oracle proposer below and in
test_speculative_rounds.py.
"""

from __future__ import annotations

import pytest

import mlx_dspark
from mlx_dspark.api import stream_generate
from tests.engine_helpers import OracleProposer

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog. " * 3,  # longer than the window (16)
    "def add(a, b):\n    return a + b\n",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]


@pytest.fixture(scope="module", params=["spark2_5", "qwen3"])
def pair(request):
    paths = request.getfixturevalue(f"tiny_{'spark' if request.param == 'spark2_5' else 'qwen3'}_pair")
    return mlx_dspark.load(str(paths[0]), draft=str(paths[1]))


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("max_tokens", [1, 5, 40])
def test_speculative_greedy_equals_plain_greedy(pair, prompt, max_tokens):
    plain = mlx_dspark.generate(pair, prompt, max_tokens=max_tokens, speculative=False)
    spec = mlx_dspark.generate(pair, prompt, max_tokens=max_tokens)
    assert spec.tokens == plain.tokens
    assert spec.text == plain.text
    assert spec.finish_reason == plain.finish_reason
    assert len(spec.acceptance_lengths) == len(spec.proposal_lengths)
    assert plain.acceptance_lengths == []
    if max_tokens > 1 and plain.finish_reason == "length":
        assert spec.acceptance_lengths, "speculative runs report one acceptance length per verify round"


def test_long_generation_crosses_both_windows_and_stays_identical(pair):
    prompt = list(range(10, 60))
    plain = mlx_dspark.generate(pair, prompt, max_tokens=150, speculative=False)
    spec = mlx_dspark.generate(pair, prompt, max_tokens=150)
    assert spec.tokens == plain.tokens


def oracle_for(pair, prompt_ids, *, errors, length=120):
    reference = mlx_dspark.generate(pair, prompt_ids, max_tokens=length, speculative=False, stop_token_ids=[])
    return reference.tokens, OracleProposer(
        reference.tokens, len(prompt_ids), pair.target.args.vocab_size, errors=errors, tap_ids=(0,)
    )


def test_stop_token_inside_accepted_drafts_ends_generation_there(pair):
    prompt = [5, 6, 7, 8, 9]
    reference, _ = oracle_for(pair, prompt, errors=lambda r: ())
    stop_at = 12  # a token in the middle of an all-accepted round
    stop_token = reference[stop_at]
    first = reference.index(stop_token)
    _, proposer = oracle_for(pair, prompt, errors=lambda r: ())
    steps = list(
        stream_generate(pair, prompt, max_tokens=100, stop_token_ids=[stop_token], proposer=proposer)
    )
    tokens = [t for s in steps for t in s.tokens]
    assert tokens == reference[: first + 1]
    assert steps[-1].finish_reason == "stop"
    plain = mlx_dspark.generate(pair, prompt, max_tokens=100, stop_token_ids=[stop_token], speculative=False)
    assert plain.tokens == tokens


@pytest.mark.parametrize("max_tokens", [2, 9, 10, 17])
def test_max_tokens_cuts_an_all_accepted_round_short(pair, max_tokens):
    prompt = [3, 1, 4, 1, 5]
    reference, proposer = oracle_for(pair, prompt, errors=lambda r: ())
    steps = list(stream_generate(pair, prompt, max_tokens=max_tokens, stop_token_ids=[], proposer=proposer))
    tokens = [t for s in steps for t in s.tokens]
    assert tokens == reference[:max_tokens]
    assert steps[-1].finish_reason == "length"


def test_stop_string_is_cut_from_text_and_matches_plain(pair):
    plain = mlx_dspark.generate(pair, "Once upon a time", max_tokens=30, speculative=False)
    if len(plain.text) < 6:
        pytest.skip("the random model produced too little text to pick a stop string from")
    stop = plain.text[3:6]
    spec = mlx_dspark.generate(pair, "Once upon a time", max_tokens=30, stop=[stop])
    plain_stopped = mlx_dspark.generate(pair, "Once upon a time", max_tokens=30, stop=[stop], speculative=False)
    assert spec.text == plain_stopped.text == plain.text[: plain.text.index(stop)]
    assert spec.finish_reason == "stop"


def test_streamed_text_joins_to_the_whole_text(pair):
    pieces = [s.text for s in mlx_dspark.stream_generate(pair, "Tell me a story", max_tokens=25)]
    whole = mlx_dspark.generate(pair, "Tell me a story", max_tokens=25)
    assert "".join(pieces) == whole.text


def test_chat_messages_are_rendered_with_the_template(pair):
    messages = [{"role": "user", "content": "hi"}]
    ids = pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    by_messages = mlx_dspark.generate(pair, messages, max_tokens=8)
    by_ids = mlx_dspark.generate(pair, list(ids), max_tokens=8)
    assert by_messages.tokens == by_ids.tokens
    assert by_messages.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"draft_sampling": "beam"}, "draft_sampling"),
        ({"p_min": 2.0}, "p_min"),
    ],
)
def test_bad_options_are_refused_by_name(pair, options, message):
    with pytest.raises(ValueError, match=message):
        mlx_dspark.generate(pair, "hi", **options)


def test_out_of_vocabulary_prompt_ids_are_refused(pair):
    with pytest.raises(ValueError, match="prompt token ids"):
        mlx_dspark.generate(pair, [1, 2, pair.target.args.vocab_size + 5])
