"""Who wrote each streamed character (engine/round/token_origins.py): the marks the server's page shows.

The oracle is independent of the streaming detokenizer: each committed token's characters are the
growth of `tokenizer.decode(tokens[: i + 1])`, and its origin is the round's block source for its
first `accepted` tokens, the target's for the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

import mlx_dspark
from mlx_dspark.api import stream_generate
from mlx_dspark.engine.round.token_origins import TextOrigins, token_origins

DEMO = Path(mlx_dspark.__file__).parent / "demo"


def test_runs_cover_a_range_and_merge_neighbours_of_one_origin():
    origins = TextOrigins()
    for end, origin in [(3, "draft"), (5, "draft"), (5, "draft"), (9, "target"), (12, "lookup")]:
        origins.add(end, origin)  # the repeated 5: a token with no characters of its own
    assert origins.runs(0, 12) == [[5, "draft"], [4, "target"], [3, "lookup"]]
    assert origins.runs(4, 10) == [[1, "draft"], [4, "target"], [1, "lookup"]]
    assert origins.runs(12, 14) == [[2, "lookup"]]  # text the detokenizer flushed at its end
    assert token_origins(3, 2, "draft", True) == ["draft", "draft", "target"]
    assert token_origins(2, 0, None, False) == ["target", "target"]


@pytest.fixture(scope="module")
def demo_pair():
    return mlx_dspark.load(str(DEMO / "target"), draft=str(DEMO / "draft"))


@pytest.mark.parametrize("lookup", ["on", "off"])
def test_marks_match_the_tokens_each_round_committed(demo_pair, lookup):
    steps = list(stream_generate(demo_pair, "    def append(self, item):\n", max_tokens=80, max_draft_tokens=7,
                                 lookup=lookup))
    tokenizer = demo_pair.tokenizer
    tokens, expected_origins = [], []
    for step in steps:
        tokens += step.tokens
        expected_origins += token_origins(len(step.tokens), step.accepted, step.source, step.verified)
        assert sum(n for n, _ in step.marks) == len(step.text)
    expected = []
    for i, origin in enumerate(expected_origins):
        grown = len(tokenizer.decode(tokens[: i + 1])) - len(tokenizer.decode(tokens[:i]))
        expected += [origin] * max(0, grown)
    marked = [origin for step in steps for n, origin in step.marks for _ in range(n)]
    text = "".join(step.text for step in steps)
    assert text == tokenizer.decode(tokens)
    assert marked == expected
    written = {origin for origin in marked if origin != "target"}
    assert written == ({"draft", "lookup"} if lookup == "on" else {"draft"})  # the demo pair accepts both
