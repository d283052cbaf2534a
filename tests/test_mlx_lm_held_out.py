"""Held-out mlx-lm families (issue 52), each through mlx-lm's own class with tiny random float32 weights and
mlx-lm's own greedy `generate` as the oracle:

- baichuan_m1 normalizes its LM head at load (NormHead, in its sanitize): a DSpark draft's copy of the head is
  read as the target reads its own, so the copy as stored in the target's checkpoint and the copy the target
  computes with both load; its layers keep a conv state beside their (sliding) K/V in a `CacheList`;
- plamo2 runs its layer list inside a decoder module under its backbone: the backbone (embedding, final norm)
  is the module above it; Mamba layers' states roll back by replay;
- rwkv7 is recurrent only, its layers hand `v_first` from layer to layer: batched, each of its layers runs
  whole per sequence (two sub-modules take the recurrent cache).

Each: speculation with injected wrong drafts (partial acceptances roll every cache kind back) equals mlx-lm's
generate, the real draft alone too, packed rows are bitwise their own forwards, batched rows equal their
solo runs, and so do the server's answers to concurrent requests under `--max-batch` (rounds shared by the
rows, each row's tokens mlx-lm's generate).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.engine.options import GenerationOptions
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.models.caches.rollback import REPLAY
from mlx_dspark.models.layers.base import FINAL_TAP
from mlx_dspark.models.packed.forward import packing_problem
from mlx_dspark.models.target import mlx_lm as mlx_lm_target
from mlx_dspark.testing.mlx_lm_checkpoints import HELD_OUT_FAMILIES, write_draft_for, write_tiny_mlx_lm_target
from mlx_dspark.testing.tiny import write_tiny_draft
from tests.test_batch_mlx_lm import check_batched_rows, check_packed_rows
from tests.test_mlx_lm_targets import PROMPT, InjectingProposer, mlx_lm_greedy
from tests.test_server import call, running_server, wait_for

TOKENS = 120


def write_pair(root: Path, family: str) -> tuple[Path, Path]:
    target = write_tiny_mlx_lm_target(root / "target", family=family, seed=0)
    if family != "baichuan_m1":  # no copy of the embedding / head (the draft uses the target's)
        return target, write_draft_for(root / "draft", target_path=target)
    # with the copies, as a DSpark draft of a Hugging Face target ships them: the head as the target stores it
    return target, write_tiny_draft(root / "draft", target_path=target, layer_family="qwen3", seed=0)


@pytest.fixture(scope="module", params=HELD_OUT_FAMILIES)
def pair(request, tmp_path_factory):
    target, draft = write_pair(tmp_path_factory.mktemp(request.param), request.param)
    loaded = prepare_model(mlx_dspark.load(str(target), str(draft)), RunSettings(ignore_eos=True))
    return request.param, target, draft, loaded


def test_held_out_speculation_is_mlx_lms_generate_with_partial_acceptances(pair):
    family, target, _, loaded = pair
    assert mlx_lm_target.is_mlx_lm_target(loaded.target) and loaded.target.mlx_lm_model_type == family
    assert REPLAY in loaded.target.make_cache().kinds  # every family here has a state that rolls back by replay
    reference = mlx_lm_greedy(target, PROMPT, TOKENS + 8)
    inner = DraftProposer(loaded.draft, loaded.target, greedy=True, temperature=1.0)
    proposer = InjectingProposer(inner, reference, prompt_len=len(PROMPT), vocab_size=loaded.target.args.vocab_size)
    # lookup off: tiny random rwkv7 repeats a short cycle, which lookup blocks would verify instead of the draft's
    result = mlx_dspark.generate(loaded, PROMPT, max_tokens=TOKENS, proposer=proposer, lookup="off")
    assert result.tokens == reference[:TOKENS]
    partial = sum(a - 1 < p for a, p in zip(result.acceptance_lengths, result.proposal_lengths))
    assert partial >= 0.6 * result.rounds, (partial, result.rounds)
    assert result.mean_acceptance_length > 2.0
    assert mlx_dspark.generate(loaded, PROMPT, max_tokens=40).tokens == reference[:40]  # the real draft alone


def test_held_out_packed_rows_are_bitwise_their_own_forwards(pair):
    family, _, _, loaded = pair
    assert packing_problem(loaded) is None
    if family == "rwkv7":  # time and channel mixing both take the recurrent cache: the whole layer per sequence
        assert loaded.target._dspark_split_mode == "layer"
    check_packed_rows(loaded.target)


def test_held_out_batched_rows_equal_their_solo_runs_and_mlx_lms_generate(pair):
    _, target, _, loaded = pair
    check_batched_rows(loaded, target)


SERVED = [(PROMPT, 14), (list(range(40, 60)), 9), ([9, 8, 7, 6, 5, 4, 3, 2, 1] * 2, 12)]  # (prompt ids, max_tokens)


def test_held_out_server_with_max_batch_answers_concurrent_requests_as_their_solo_runs(pair, monkeypatch):
    """Three concurrent greedy completions on `--max-batch 3`: every row's tokens (read off the rounds the
    worker runs) are mlx-lm's generate, each answer is the same request's answer served alone, and the rows
    decoded in shared rounds, drafting 3 tokens a round (the random draft's rejections roll each row back)."""
    from mlx_dspark.serve import batch_worker

    family, target, _, loaded = pair
    rows, tokens, widths = {}, {}, []
    shared_round = batch_worker.batch_round
    all_queued = threading.Event()  # set once the first round has waited for the other requests

    def recording_round(model, batch, **options):  # the worker's rounds, as it runs them
        if not all_queued.is_set():  # the first round: the requests not in it wait in the queue, to join the next one
            all_queued.set()
            assert wait_for(lambda: len(batch) + server.worker.queued == len(SERVED), timeout=30)
        widths.append(sum(not row.prefilling for row in batch))  # rows decoding in this round
        shared_round(model, batch, **options)
        for row in batch:
            rows[tuple(row.prompt)] = row
            tokens.setdefault(tuple(row.prompt), []).extend(t for r in row.rounds for t in r.tokens)

    monkeypatch.setattr(batch_worker, "batch_round", recording_round)
    defaults = GenerationOptions.from_keywords(lookup="off")  # as above: the draft's blocks, not lookup's, are verified
    with running_server(lambda: loaded, defaults=defaults, max_batch=3, batch_prefill_chunk=8) as server:
        assert server.worker.load_error is None and isinstance(server.worker, batch_worker.BatchWorker)

        def complete(prompt, n):
            status, _, reply = call(server, "POST", "/v1/completions",
                                    {"prompt": prompt, "max_tokens": n, "temperature": 0, "max_draft_tokens": 3})  # fmt: skip
            assert status == 200, reply
            assert reply["usage"]["completion_tokens"] == n  # the end-of-sequence id is ignored (prepare_model)
            return reply["choices"][0]["text"]

        together: dict[int, str] = {}
        gate = threading.Barrier(len(SERVED))

        def run(i, prompt, n):
            gate.wait()
            together[i] = complete(prompt, n)

        threads = [threading.Thread(target=run, args=(i, *served)) for i, served in enumerate(SERVED)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert server.worker.peak_active == len(SERVED), family
        assert sum(width >= 2 for width in widths) >= 5, f"{family}: rows decoded in shared rounds {widths}"
        for i, (prompt, n) in enumerate(SERVED):
            assert tokens[tuple(prompt)][:n] == mlx_lm_greedy(target, prompt, n), f"{family} request {i}: mlx-lm's generate"
            row = rows[tuple(prompt)]
            assert 0 <= row.accepted < row.proposed, f"{family} request {i}: the row drafted and rolled back"
        widths.clear()
        for i, (prompt, n) in enumerate(SERVED):
            assert complete(prompt, n) == together[i], f"{family} request {i}: the answer served alone"
        assert max(widths) == 1


@pytest.mark.parametrize("pair", ["plamo2"], indirect=True)
def test_plamo2_backbone_is_the_module_that_embeds_and_norms(pair):
    _, _, _, loaded = pair
    target = loaded.target
    assert target.embedding is target.model.embed_tokens and target._backbone is target.model
    cache = target.make_cache()
    logits, final = target(mx.array([PROMPT]), cache=cache, tap_ids=(FINAL_TAP,))
    normed = target.model.norm(target.model.layers(target.model.embed_tokens(mx.array([PROMPT])), None))
    assert mx.allclose(final, normed, atol=1e-5).item()  # the final tap is the normed state, not the decoder's output
    assert mx.allclose(target.lm_head_logits(final), logits, atol=1e-4).item()


@pytest.mark.parametrize("pair", ["baichuan_m1"], indirect=True)
def test_baichuan_m1_drafts_head_copy_is_compared_with_the_head_it_computes_with(pair, tmp_path):
    """The target's head rows are unit rows (mlx-lm's sanitize); a draft holding them as stored (raw) or as
    computed with (normalized) loads; a draft holding another head is refused."""
    _, target, draft, loaded = pair
    head = np.array(loaded.target.lm_head.weight)
    assert np.allclose(np.linalg.norm(head, axis=-1), 1.0, atol=1e-5)
    stored = np.array(mx.load(str(draft / "model.safetensors"))["lm_head.weight"])
    assert not np.allclose(stored, head, atol=1e-3)  # the draft's copy is the raw tensor: the pair above loaded

    def with_head(name: str, rows: np.ndarray) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_bytes((draft / "config.json").read_bytes())
        weights = mx.load(str(draft / "model.safetensors"))
        weights["lm_head.weight"] = mx.array(rows.astype(np.float32))
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
        return path

    computed = prepare_model(mlx_dspark.load(str(target), str(with_head("normalized", head))), RunSettings(ignore_eos=True))
    assert mlx_dspark.generate(computed, PROMPT, max_tokens=40).tokens == mlx_lm_greedy(target, PROMPT, 40)
    other = stored + 0.05 * np.random.default_rng(7).standard_normal(stored.shape)
    with pytest.raises(ValueError, match="draft tensor 'lm_head.weight' differs from the target's head"):
        mlx_dspark.load(str(target), str(with_head("other", other)))


@pytest.mark.parametrize("pair", ["baichuan_m1"], indirect=True)
def test_baichuan_m1_rolls_a_verify_back_twice_exactly_past_its_window(pair):
    """Its layers' caches are CacheList(conv state, RotatingKVCache window 8): rolled back by restoring both and
    replaying the layer. Keeping one position writes the window in place; rolling the same verify back again
    (to before it) must still find the window as it was."""
    _, _, _, loaded = pair
    target = loaded.target
    ids = mx.array([PROMPT * 2])  # 24 positions: past the window
    cache = target.make_cache()
    target(ids, cache=cache)
    target(mx.array([[5, 6, 7, 8, 9]]), cache=cache)
    cache.rollback(4)  # keep 5
    cache.rollback(1)  # and back to before the verify
    logits, _ = target(mx.array([[11]]), cache=cache)
    fresh, _ = target(mx.concatenate([ids, mx.array([[11]])], axis=1))
    assert mx.allclose(logits[:, -1], fresh[:, -1], atol=1e-4).item()
