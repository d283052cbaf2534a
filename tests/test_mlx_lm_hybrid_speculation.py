"""Speculation on hybrid and windowed mlx-lm targets (issue 25): the adapter's caches are a
`models/rollback.RollbackCaches`, so a partial acceptance rolls back recurrent states (restore + replay of
the layer), rotating windows (restore + re-append) and KV caches (trim) exactly.

The oracle is mlx-lm's own `stream_generate` (what `mlx_lm.generate` runs) on the same checkpoint; the
proposer injects one wrong token in most rounds at varied positions (tests/test_mlx_lm_targets.py).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache

import mlx_dspark
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.engine.costs.probe import measure_cost_curve as REAL_MEASURE_COST_CURVE  # bound before conftest's patch
from mlx_dspark.engine.round.decode import speculative_steps
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.models.target import mlx_lm as mlx_lm_target
from mlx_dspark.models.caches.rollback import REPLAY, ROTATING, RollbackCaches
from mlx_dspark.testing.draft_layouts import write_gemma4_draft
from mlx_dspark.testing.mlx_lm_checkpoints import tiny_mlx_lm_config, write_draft_for, write_tiny_mlx_lm_target
from tests.engine_helpers import sampled_prefix
from tests.test_lossless_sampling import RandomDraftProposer, chi_square_p_value, marginals, to_array
from tests.test_mlx_lm_targets import PROMPT, TOKENS, InjectingProposer, mlx_lm_greedy

WINDOW = 8  # gemma4_text's sliding window here: the rotating caches wrap many times in 210 tokens
FAMILIES = {  # family -> the cache kinds its rollback must go through besides trim
    "qwen3_5": {REPLAY},  # GatedDeltaNet
    "qwen3_5_moe": {REPLAY},  # GatedDeltaNet + MoE MLPs
    "lfm2": {REPLAY},  # short convolutions
    "nemotron_h": {REPLAY},  # Mamba-2 (and MLP blocks without a cache)
    "gemma4_text": {ROTATING},  # sliding-window layers
}


def write_target(root: Path, family: str) -> Path:
    overrides = {"sliding_window": WINDOW} if family == "gemma4_text" else {}
    return write_tiny_mlx_lm_target(root / "target", family=family, seed=0, **overrides)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory) -> tuple[str, Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    target = write_target(root, request.param)
    return request.param, target, write_draft_for(root / "draft", target_path=target)


def injected_run(loaded, target: Path, prompt: list[int], tokens: int):
    reference = mlx_lm_greedy(target, prompt, tokens + 8)
    inner = DraftProposer(loaded.draft, loaded.target, greedy=True, temperature=1.0)
    proposer = InjectingProposer(inner, reference, prompt_len=len(prompt), vocab_size=loaded.target.args.vocab_size)
    return reference, mlx_dspark.generate(loaded, prompt, max_tokens=tokens, proposer=proposer)


def test_speculative_greedy_on_hybrid_and_windowed_targets_is_mlx_lms_generate(pair):
    family, target, draft = pair
    loaded = prepare_model(mlx_dspark.load(str(target), str(draft)), RunSettings(ignore_eos=True))
    assert mlx_lm_target.is_mlx_lm_target(loaded.target) and loaded.target.mlx_lm_model_type == family
    cache = loaded.target.make_cache()
    assert isinstance(cache, RollbackCaches) and FAMILIES[family] <= set(cache.kinds), cache.kinds
    reference, result = injected_run(loaded, target, PROMPT, TOKENS)
    assert result.tokens == reference[:TOKENS]
    partial = sum(a - 1 < p for a, p in zip(result.acceptance_lengths, result.proposal_lengths))
    assert partial >= 0.6 * result.rounds, (partial, result.rounds)
    assert result.mean_acceptance_length > 2.0


def test_the_windowed_caches_wrap_and_a_rollback_across_the_wrap_is_exact(tmp_path):
    """gemma4_text, window 8: after a wrapped verify, rolling back and decoding on gives the same logits
    as a fresh run of the kept tokens (mlx-lm's own trim would leave rejected keys in the window)."""
    target = mlx_dspark.load(str(write_target(tmp_path, "gemma4_text"))).target
    ids = mx.array([PROMPT * 3])  # 36 tokens: past the window
    cache = target.make_cache()
    target(ids, cache=cache)
    verify = mx.array([[5, 6, 7, 8, 9, 10]])
    target(verify, cache=cache)
    rotating = [c for c in cache if isinstance(c, RotatingKVCache)]
    assert rotating and all(c.offset > WINDOW for c in rotating)
    from mlx_dspark.models.caches.kv import trim_caches

    trim_caches(cache, 4)  # keep 5, 6
    logits, _ = target(mx.array([[11]]), cache=cache)
    fresh, _ = target(mx.concatenate([ids, verify[:, :2], mx.array([[11]])], axis=1))
    assert mx.allclose(logits[:, -1], fresh[:, -1], atol=1e-4).item()


@pytest.mark.parametrize("pair", ["gemma4_text", "lfm2", "nemotron_h", "qwen3_5"], indirect=True)  # qwen3_5_moe: as qwen3_5's caches
def test_prompt_cache_serves_speculative_turns_on_hybrid_and_windowed_targets_exactly(pair):
    """Through `mlx_dspark.generate(..., prompt_cache=)`: every turn equals a cold run and mlx-lm's generate
    and reports the reused prefix (recurrent / rotating states from the live caches or a snapshot)."""
    _, target, draft = pair
    loaded = prepare_model(mlx_dspark.load(str(target), str(draft)), RunSettings(ignore_eos=True))
    cache = mlx_dspark.make_prompt_cache(loaded)
    prompt = list(PROMPT)
    first = mlx_dspark.generate(loaded, prompt, max_tokens=30, prompt_cache=cache)
    assert first.tokens == mlx_lm_greedy(target, prompt, 30) and first.rounds > 0
    follow_up = prompt + first.tokens + [11, 12, 13]
    warm = mlx_dspark.generate(loaded, follow_up, max_tokens=30, prompt_cache=cache)
    assert warm.cached_tokens >= len(prompt) + 29
    assert warm.tokens == mlx_dspark.generate(loaded, follow_up, max_tokens=30).tokens == mlx_lm_greedy(target, follow_up, 30)
    edited = follow_up[:-2] + [40, 41]  # the last turn edited: rewinds past the live caches' latest forward
    again = mlx_dspark.generate(loaded, edited, max_tokens=20, prompt_cache=cache)
    assert 0 < again.cached_tokens < len(edited) - 1
    assert again.tokens == mlx_lm_greedy(target, edited, 20)


# -- sampled speculation: the target's exact distribution ------------------------------------------

VOCAB = 8
CHI_PROMPT = [1, 5, 2, 7, 3]
RUNS = 400
CHI_SAMPLER = Sampler(temperature=0.5)  # peaked enough that a wrong recurrent state shows in 400 runs


@pytest.fixture(scope="module")
def tiny_vocab_hybrid():
    """A qwen3_5 adapter target with 8 tokens: 3 GatedDeltaNet layers + 1 attention layer, random weights
    (testing's init; large embeddings so that the recurrent state moves the next token)."""
    from mlx.utils import tree_flatten, tree_unflatten

    from mlx_dspark.testing.mlx_lm_checkpoints import _random

    config = tiny_mlx_lm_config("qwen3_5", {"bos": 1, "eos": 2, "pad": 0})
    config["text_config"].update(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=2, head_dim=32,
                                 linear_num_value_heads=2, linear_num_key_heads=1, full_attention_interval=4)  # fmt: skip
    target = mlx_lm_target.from_config(config)
    rng = np.random.default_rng(3)
    weights = [(n, mx.array(_random(rng, n, tuple(p.shape)) * (50.0 if "embed" in n else 1.0))) for n, p in tree_flatten(target.parameters())]
    target.update(tree_unflatten(weights))
    mlx_lm_target.probe_target(target)
    return target


def sampled_outcomes(target, exact: np.ndarray, length: int) -> tuple[Counter, Counter]:
    mx.random.seed(77)
    outcomes, stats = Counter(), Counter()
    for _ in range(RUNS):
        proposer = RandomDraftProposer(greedy=False, guide=marginals(exact)[1:])
        outcomes[sampled_prefix(speculative_steps(target, proposer, CHI_PROMPT, sampler=CHI_SAMPLER), length, stats)] += 1
    return outcomes, stats


def test_sampled_speculation_on_a_hybrid_matches_the_exact_target_distribution(tiny_vocab_hybrid):
    from tests.test_lossless_sampling import PROMPT as LS_PROMPT, exact_distribution

    assert LS_PROMPT == CHI_PROMPT
    exact = exact_distribution(tiny_vocab_hybrid, CHI_SAMPLER, 3)
    outcomes, stats = sampled_outcomes(tiny_vocab_hybrid, exact, 3)
    assert stats["accepted"] > 0 and stats["rejected"] > stats["rounds"] // 5  # recurrent states rolled back
    counts = to_array(outcomes, 3)
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > 1e-4
    for observed, expected in zip(marginals(counts), marginals(exact)):
        assert chi_square_p_value(observed, expected) > 1e-4


def test_the_chi_square_catches_a_recurrent_state_left_unreplayed(tiny_vocab_hybrid, monkeypatch):
    """The check above can fail on this target: a rollback that restores the GatedDeltaNet state from
    before the verify without replaying the kept positions is caught."""
    from mlx_dspark.models.caches import rollback
    from tests.test_lossless_sampling import exact_distribution

    def restore_only(self, i, kept):
        rollback.restore_layer(self[i], self._forward.before[i])

    exact = exact_distribution(tiny_vocab_hybrid, CHI_SAMPLER, 3)
    monkeypatch.setattr(rollback.RollbackCaches, "_replay", restore_only)
    outcomes, _ = sampled_outcomes(tiny_vocab_hybrid, exact, 3)
    assert chi_square_p_value(to_array(outcomes, 3).reshape(-1), exact.reshape(-1)) < 1e-6


# -- the gemma embed / head contract ----------------------------------------------------------------


def test_gemma4_target_shares_its_raw_table_and_head_with_a_deepspec_gemma4_draft(tmp_path):
    """The adapter's `embed` / `lm_head_logits` are the raw table ops; DeepSpec's gemma4 draft applies
    sqrt(hidden) and the final softcap itself (deepspec/modeling/dspark/gemma4/modeling.py), so neither is
    applied twice. Lossless greedy against mlx-lm's generate, with the real draft proposing."""
    target_path = write_target(tmp_path, "gemma4_text")
    draft_path = write_gemma4_draft(tmp_path / "draft", target_path=target_path, seed=1)
    loaded = prepare_model(mlx_dspark.load(str(target_path), str(draft_path)), RunSettings(ignore_eos=True))
    target = loaded.target
    table = target.embedding.weight
    ids = mx.array([[3, 17, 200]])
    assert mx.array_equal(target.embed(ids), table[ids]).item()  # raw rows: no sqrt(hidden)
    h = mx.random.normal((1, 3, target.args.hidden_size))
    assert mx.allclose(target.lm_head_logits(h), h @ table.T, atol=1e-5).item()  # no softcap
    capped = mx.tanh((h @ table.T) / 30.0) * 30.0  # mlx-lm's own head (final_logit_softcapping 30)
    assert mx.allclose(target.model_head_logits(h), capped, atol=1e-4).item()
    # the draft's block embeddings are sqrt(hidden) times the table rows, once
    block = loaded.draft.embed_block(ids, target=target)
    assert mx.allclose(block, table[ids] * mx.array(target.args.hidden_size**0.5, dtype=table.dtype), atol=1e-6).item()
    reference, result = injected_run(loaded, target_path, PROMPT, 120)
    assert result.tokens == reference[:120]
    plain_draft = mlx_dspark.generate(loaded, PROMPT, max_tokens=40)
    assert plain_draft.tokens == reference[:40]


def test_a_head_that_is_not_the_plain_product_is_shared_as_mlx_lms_own(tmp_path):
    """The probe checks that the plain head product (lm_head / tied table) ranks tokens as the model's
    logits do; a model whose head is something else (internlm2's `output`, talkie's gained array) shares
    mlx-lm's own head code with its draft instead. A model whose plain head is its head keeps it."""
    from mlx_lm.models import llama

    class Model(llama.Model):  # logits from a head other than lm_head
        def __call__(self, inputs, cache=None, input_embeddings=None):
            return -self.lm_head(self.model(inputs, cache, input_embeddings))

    config = json.loads((write_tiny_mlx_lm_target(tmp_path / "t", family="llama") / "config.json").read_text())
    h = mx.random.normal((1, 3, config["hidden_size"]))
    for model_class, own in ((Model, True), (llama.Model, False)):
        mx.random.seed(0)
        model = mlx_lm_target.from_config(config, model_class=model_class)
        mlx_lm_target.probe_target(model)
        assert model.head_is_models_own is own
        expected = -model.lm_head(h) if own else model.lm_head(h)
        assert mx.allclose(model.lm_head_logits(h), expected, atol=1e-5).item()


def test_server_answers_a_chat_with_tools_on_a_hybrid_as_the_api_does(tmp_path):
    """qwen3_5 (GatedDeltaNet hybrid) behind the server: a chat with tools, speculative, as `generate`."""
    from mlx_dspark.api import encode_prompt
    from mlx_dspark.testing.tiny_tokenizer import tools_chat_template, write_chat_template
    from tests.test_server import call, pair_loader, running_server
    from tests.test_server_agents import HISTORY, WEATHER

    target = write_target(tmp_path, "qwen3_5")
    write_chat_template(target, tools_chat_template())  # Qwen3's <tool_call> JSON format (mlx-lm's json_tools)
    draft = write_draft_for(tmp_path / "draft", target_path=target)
    with running_server(pair_loader((target, draft))) as server:
        body = {"model": "tiny-spark", "messages": HISTORY, "tools": [WEATHER], "max_tokens": 24}
        status, _, reply = call(server, "POST", "/v1/chat/completions", body)
        want = mlx_dspark.generate(server.worker.model, HISTORY, tools=[WEATHER], max_tokens=24)
    assert status == 200, reply
    tokenizer = server.worker.model.tokenizer
    prompt = encode_prompt(tokenizer, HISTORY, tools=[WEATHER])
    assert reply["usage"]["prompt_tokens"] == len(prompt) > len(encode_prompt(tokenizer, HISTORY))
    assert reply["usage"]["completion_tokens"] == len(want.tokens) and want.rounds > 0
    assert (reply["choices"][0]["message"]["content"] or "") == (want.content or "")
    assert want.tokens == mlx_lm_greedy(target, prompt, 24)[: len(want.tokens)]


@pytest.mark.parametrize("pair", ["qwen3_5", "gemma4_text"], indirect=True)
def test_a_gguf_draft_on_hybrid_and_windowed_targets_runs_as_its_safetensors_and_is_lossless(pair, tmp_path):
    """The draft as llama.cpp's converter writes it (dflash GGUF, no shared copies: it uses the target's)."""
    from mlx_dspark.testing.gguf_writer import write_gguf_draft

    _, target, draft = pair
    gguf = write_gguf_draft(draft, tmp_path / "draft.gguf", target_path=target, include_shared=False)
    from_gguf = prepare_model(mlx_dspark.load(str(target), draft=str(gguf)), RunSettings(ignore_eos=True))
    from_safetensors = prepare_model(mlx_dspark.load(str(target), str(draft)), RunSettings(ignore_eos=True))
    assert from_gguf.draft_path == gguf
    runs = [mlx_dspark.generate(p, PROMPT, max_tokens=40) for p in (from_gguf, from_safetensors)]
    assert runs[0].tokens == runs[1].tokens == mlx_lm_greedy(target, PROMPT, 40)
    assert runs[0].acceptance_lengths == runs[1].acceptance_lengths and runs[0].rounds > 0
    reference, result = injected_run(from_gguf, target, PROMPT, 60)
    assert result.tokens == reference[:60]


def test_the_confidence_schedule_and_its_cost_probe_run_on_a_hybrid(tmp_path):
    """The cost curve times width-1 steps too: on a hybrid those are restored from copies (a width-1
    forward is never recorded for rollback); the schedule's output stays mlx-lm's."""
    from mlx_dspark.bench.cost import CostProbe

    target = write_target(tmp_path, "qwen3_5")
    loaded = prepare_model(mlx_dspark.load(str(target), str(write_draft_for(tmp_path / "draft", target_path=target))), RunSettings(ignore_eos=True))
    curve = REAL_MEASURE_COST_CURVE(loaded.target, loaded.draft, context=24, repeats=1)  # the real one, not conftest's stand-in
    probe = CostProbe(loaded, context=24)
    probe.decode(), probe.verify(1), probe.verify(3)
    result = mlx_dspark.generate(loaded, PROMPT, max_tokens=40, verify_schedule="confidence", cost_curve=curve)
    assert result.tokens == mlx_lm_greedy(target, PROMPT, 40) and result.rounds > 0
