"""Tree rounds through the server (issue 37): the per-request `tree_nodes` field, its bad values, and the
chain rounds (with one note) a batched server or a request trees cannot serve runs instead."""

from __future__ import annotations

import warnings

import pytest

from mlx_dspark.api import generate
from mlx_dspark.engine.options import GenerationOptions, SpeculationOptions
from tests.test_server import MESSAGES, call, pair_loader, running_server

PROMPT = "Once upon a time"
LOOKUP_OFF = GenerationOptions(max_tokens=8, speculation=SpeculationOptions(lookup="off"))


def completion(srv, body: dict) -> tuple[list[str], dict]:
    """The completion of `body` and the tree fallback notes given while it ran."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status, _, reply = call(srv, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 20, **body})
    assert status == 200, reply
    return [str(w.message) for w in caught if "chain rounds instead of tree rounds" in str(w.message)], reply


def plain_text(srv, **options) -> str:
    return generate(srv.worker.model, PROMPT, max_tokens=20, speculative=False, **options).text


def test_a_request_s_tree_nodes_is_plain_decoding_and_with_logit_bias_runs_chains_with_one_note_and_bad_values_are_400(tiny_qwen3_pair):
    with running_server(pair_loader(tiny_qwen3_pair), defaults=LOOKUP_OFF) as srv:
        notes, reply = completion(srv, {"tree_nodes": 6})
        assert reply["choices"][0]["text"] == plain_text(srv)
        assert notes == []
        notes, reply = completion(srv, {"tree_nodes": 6, "logit_bias": {"7": 3.0}})  # a chain round's feature
        assert reply["choices"][0]["text"] == plain_text(srv, logit_bias={7: 3.0})
        assert len(notes) == 1 and "logit_bias" in notes[0], notes
        for bad in ("many", -1, 65, True):
            status, _, body = call(srv, "POST", "/v1/chat/completions", {"messages": MESSAGES, "tree_nodes": bad})
            assert status == 400 and body["error"]["param"] == "tree_nodes", body


@pytest.mark.parametrize("where", ["request", "server"])
def test_a_batched_server_asked_for_trees_runs_chain_rounds_and_says_so_once(tiny_qwen3_pair, where):
    defaults = LOOKUP_OFF if where == "request" else LOOKUP_OFF.replace(tree_nodes="auto")
    body = {"tree_nodes": 8} if where == "request" else {}
    with running_server(pair_loader(tiny_qwen3_pair), defaults=defaults, max_batch=2) as srv:
        notes, reply = completion(srv, body)
        assert reply["choices"][0]["text"] == plain_text(srv)
        assert len(notes) == 1 and "a batched row" in notes[0], notes
