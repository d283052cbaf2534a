"""Gemma 4 assistant drafters (`Gemma4AssistantForCausalLM`, issue 35.3): the HF checkpoint loads beside a
tiny gemma4_text target (sliding and full layers, a window that wraps), a proposal equals an independent NumPy
restatement of the assistant's steps over the target's last sliding / full layers' K/V (tests/
gemma4_assistant_reference.py), greedy speculation is plain decoding token for token, after rounds with
partial acceptances the live caches give the proposal a fresh prefill of the committed tokens gives (no
rejected row is read), sampled speculation keeps the target's exact distribution, and a mismatched pair is
refused by field."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

import mlx_dspark
from mlx_dspark.engine.round.decode import prefill, speculative_steps
from mlx_dspark.engine.proposers.gemma4_assistant import AssistantProposer
from mlx_dspark.engine.options import SpeculationOptions
from mlx_dspark.engine.proposers.base import Proposal, Proposer
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.models.heads.gemma4_assistant.model import AssistantArgs, Gemma4AssistantDraft
from mlx_dspark.models.target.mlx_lm import from_config, probe_target
from mlx_dspark.testing.gemma4_assistant_tiny import assistant_config, assistant_weights, write_assistant
from mlx_dspark.testing.mlx_lm_checkpoints import tiny_mlx_lm_config, tiny_mlx_lm_weights, write_tiny_mlx_lm_target
from tests.engine_helpers import assert_chain_sampling_is_exact, sampled_prefix
from tests.gemma4_assistant_reference import AssistantReference, GemmaTargetKV

PROMPT = [1, 5, 9, 20, 33, 7, 100, 250, 3, 64, 17, 42]  # longer than the sliding window: it wraps in the prefill
WINDOW = 8
FIXED = SpeculationOptions(max_draft_tokens=3)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gemma4_assistant")


@pytest.fixture(scope="module")
def gemma(root) -> Path:
    return write_tiny_mlx_lm_target(root / "gemma4", family="gemma4_text", seed=0, sliding_window=WINDOW)


@pytest.fixture(scope="module", params=["tied", "ordered"])
def pair(request, root, gemma):
    """The dense tied head with the unused k/v tensors in the file; the E2B-style centroid head without them."""
    ordered = request.param == "ordered"
    draft = write_assistant(root / request.param, target_path=gemma, seed=1, ordered=ordered, unused_kv=not ordered, table_scale=4.0)
    return gemma, draft, mlx_dspark.load(str(gemma), draft=str(draft))


def _proposal_at(pair, sequence, anchor, n, cache=None):
    """A greedy proposal of `n` after `anchor` from a fresh prefill of `sequence` (or the given live `cache`)."""
    proposer = AssistantProposer(pair.heads["assistant"], pair.target, greedy=True, temperature=1.0, block_size=n)
    fresh = pair.target.make_cache() if cache is None else cache
    prefill(pair.target, fresh, sequence, tap_ids=proposer.tap_ids, proposer=proposer)
    return proposer, proposer.propose(mx.array([anchor]), position=len(sequence), num_tokens=n, target_cache=fresh), fresh


def test_a_proposal_is_the_numpy_restatement_over_the_targets_last_sliding_and_full_layers(pair):
    target_dir, draft_dir, loaded = pair
    assert loaded.draft is None and isinstance(loaded.heads["assistant"], Gemma4AssistantDraft)
    assert GemmaTargetKV(target_dir).cfg["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert_the_restatements_proposal(target_dir, draft_dir, loaded)


SHARED_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
TARGET_VARIANTS = {  # a target of the published kinds the tiny one is not
    # E2B / E4B: the last layers KV-shared (the assistant reads the last non-shared layer of each type: 1 and 2,
    # not 4 and 5), per-layer inputs, a wider window
    "kv-shared-per-layer-input": dict(num_hidden_layers=6, layer_types=SHARED_TYPES, num_kv_shared_layers=3,
                                      hidden_size_per_layer_input=16, sliding_window=10),
    # 26B-A4B / 31B: full layers without v_proj (values = the raw keys), their own KV head count
    "k-eq-v": dict(attention_k_eq_v=True, num_global_key_value_heads=1, sliding_window=6),
    "window-wider-than-the-context": dict(sliding_window=64),  # the sliding layer's K/V: every row so far
}


@pytest.mark.parametrize("variant", list(TARGET_VARIANTS))
def test_target_variants_give_the_restatements_proposal(variant, root):
    target_dir = write_tiny_mlx_lm_target(root / f"gemma-{variant}", family="gemma4_text", seed=5, **TARGET_VARIANTS[variant])
    draft_dir = write_assistant(root / f"assistant-{variant}", target_path=target_dir, seed=6, table_scale=4.0)
    assert_the_restatements_proposal(target_dir, draft_dir, mlx_dspark.load(str(target_dir), draft=str(draft_dir)))


def assert_the_restatements_proposal(target_dir: Path, draft_dir: Path, loaded) -> None:
    target, model = loaded.target, loaded.heads["assistant"]
    kv_ref = GemmaTargetKV(target_dir)
    window, C = kv_ref.cfg["sliding_window"], kv_ref.cfg["hidden_size"]
    sliding, full = kv_ref.source("sliding_attention"), kv_ref.source("full_attention")
    _, features = target(mx.array([PROMPT]), tap_ids=(sliding - 1, full - 1))  # those layers' inputs
    inputs = np.array(features[0], dtype=np.float64)
    keys_s, values_s = kv_ref.kv(sliding, inputs[:, :C])
    kv = {"sliding_attention": (keys_s[:, -window:], values_s[:, -window:]), "full_attention": kv_ref.kv(full, inputs[:, C:])}
    hidden = np.array(target.model(mx.array([PROMPT])), dtype=np.float64)[0, -1]  # mlx-lm's own final normed state
    reference = AssistantReference(draft_dir, kv_ref.embed_table)
    anchor = 77
    expected, first_logits = reference.greedy_chain(anchor, hidden, kv, len(PROMPT) - 1, 4)
    _, proposal, cache = _proposal_at(loaded, PROMPT, anchor, 4)
    assert proposal.tokens[0].tolist() == expected
    shared = model.shared_kv(cache, target.layer_types)
    assert shared["sliding_attention"][0].shape[2] == min(window, len(PROMPT)) and shared["full_attention"][0].shape[2] == len(PROMPT)
    y = model(model.embed(mx.array([[anchor]]), target), mx.array(hidden[None, None], dtype=mx.float32), shared, position=len(PROMPT) - 1)
    ours = np.array(model.logits(y)[0, 0])
    assert np.abs(ours - first_logits).max() < 1e-3 * max(1.0, np.abs(first_logits).max())


class Injecting(Proposer):
    """The real assistant proposer runs every round over the live caches, but the block verified is the
    reference continuation with one wrong token in most rounds: partial acceptances of every length."""

    takes_target_cache = True

    def __init__(self, inner: AssistantProposer, reference: list[int], vocab: int):
        self.inner, self.reference, self.vocab = inner, reference, vocab
        self.tap_ids, self.block_size = inner.tap_ids, inner.block_size
        self.rng = random.Random(0)

    def extend(self, features):
        self.inner.extend(features)

    def propose(self, anchor, *, position, num_tokens, target_cache):
        mx.eval(self.inner.propose(anchor, position=position, num_tokens=num_tokens, target_cache=target_cache).tokens)
        self.cache = target_cache
        start = position - len(PROMPT) + 1
        tokens = list(self.reference[start : start + num_tokens])
        if self.rng.random() < 0.8:
            k = self.rng.randrange(num_tokens)
            tokens[k] = (tokens[k] + 1) % self.vocab
        return Proposal(tokens=mx.array([tokens], dtype=mx.int32))


def test_greedy_assistant_speculation_is_plain_decoding_and_reads_no_rejected_row(pair):
    _, _, loaded = pair
    plain = mlx_dspark.generate(loaded, PROMPT, max_tokens=220, speculative=False).tokens
    spec = mlx_dspark.generate(loaded, PROMPT, max_tokens=220, max_draft_tokens=3, lookup="off")
    assert spec.tokens == plain and len(plain) == 220 and spec.rounds > 0
    # partial acceptances of every length, the sliding caches wrapped: the live caches then give the proposal a
    # fresh prefill of the committed tokens gives
    target = loaded.target
    inner = AssistantProposer(loaded.heads["assistant"], target, greedy=True, temperature=1.0, block_size=4)
    proposer, stats = Injecting(inner, plain, target.args.vocab_size), Counter()
    tokens = sampled_prefix(speculative_steps(target, proposer, PROMPT, sampler=Sampler(), speculation=FIXED), 60, stats)
    assert tokens == tuple(plain[:60]) and stats["rejected"] >= stats["rounds"] // 2 and stats["accepted"] > 10
    position = inner.positions
    committed = PROMPT + plain[: position - len(PROMPT)]
    anchor = plain[position - len(PROMPT)]
    live = inner.propose(mx.array([anchor]), position=position, num_tokens=4, target_cache=proposer.cache)
    _, fresh, _ = _proposal_at(loaded, committed, anchor, 4)
    assert live.tokens.tolist() == fresh.tokens.tolist()
    assert np.allclose(np.array(live.token_probs), np.array(fresh.token_probs), atol=1e-5)


# -- sampled: the target's exact distribution --------------------------------------------------------------

VOCAB = 8
CHI_SAMPLER = Sampler(temperature=0.8)
RUNS = 300


@pytest.fixture(scope="module")
def tiny_vocab_pair():
    """An 8-token gemma4_text target (window 3: it wraps within the prompt) and a random assistant, in memory."""
    config = tiny_mlx_lm_config("gemma4_text", {"bos": 1, "eos": 2, "pad": 0}, vocab_size=VOCAB, sliding_window=3)
    target = from_config(config)
    weights = {k: mx.array(v) for k, v in tiny_mlx_lm_weights(config, seed=3).items()}
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * 100.0  # logits that depend on the context
    target.update(tree_unflatten(list(target.sanitize(weights).items())))
    draft_config = assistant_config(config)
    draft = Gemma4AssistantDraft(AssistantArgs.from_dict(draft_config))
    stored = {k: mx.array(v) for k, v in assistant_weights(draft_config, seed=4, table_scale=3.0).items()}
    draft.update(tree_unflatten(list(draft.sanitize(stored).items())))
    mx.eval(target.parameters(), draft.parameters())
    probe_target(target)
    assert len(tree_flatten(draft.parameters())) == len(draft.sanitize(stored))
    return target, draft


def test_sampled_assistant_speculation_is_the_exact_target_distribution(tiny_vocab_pair):
    target, draft = tiny_vocab_pair
    make = lambda: AssistantProposer(draft, target, greedy=False, temperature=CHI_SAMPLER.temperature)  # noqa: E731
    assert_chain_sampling_is_exact(target, make, sampler=CHI_SAMPLER, speculation=FIXED, runs=RUNS, seed=11)


# -- refusals --------------------------------------------------------------------------------------------


def _edit(path: Path, change) -> None:
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(backbone_hidden_size=64), r"config\.json: backbone_hidden_size is 64 but the target .* has 128"),
        (lambda c: c["text_config"].update(vocab_size=500), r"config\.json: text_config\.vocab_size is 500 but the target"),
        (lambda c: c["text_config"].update(head_dim=16), r"config\.json: text_config\.head_dim is 16 but the target .* has 32"),
        (lambda c: c["text_config"].update(global_head_dim=32), r"text_config\.global_head_dim is 32 but the target .* has 64"),
        (lambda c: c["text_config"].update(sliding_window=512), r"text_config\.sliding_window is 512 but the target .* has 8"),
        (lambda c: c["text_config"].update(num_attention_heads=3), r"num_attention_heads 3 is not a multiple of the target's 2"),
        (lambda c: c["text_config"].update(enable_moe_block=True), r"field 'text_config\.enable_moe_block' is True"),
        (lambda c: c["text_config"].update(num_kv_shared_layers=1), r"field 'text_config\.num_kv_shared_layers' is 1"),
        (lambda c: c.pop("text_config"), r"field 'text_config' must be an object"),
    ],
)
def test_a_mismatched_pair_is_refused_naming_the_file_and_field(change, message, gemma, tmp_path):
    draft = write_assistant(tmp_path / "draft", target_path=gemma, seed=2)
    _edit(draft, change)
    with pytest.raises(ValueError, match=message):
        mlx_dspark.load(str(gemma), draft=str(draft))


def test_a_non_gemma_target_and_kv_bits_are_refused(gemma, root, tmp_path):
    draft = write_assistant(tmp_path / "draft", target_path=gemma, seed=2)
    llama = write_tiny_mlx_lm_target(root / "llama", family="llama", seed=0)
    with pytest.raises(ValueError, match=r"a Gemma 4 assistant drafts for a Gemma 4 target .* is 'llama'"):
        mlx_dspark.load(str(llama), draft=str(draft))
    with pytest.raises(ValueError, match=r"kv_bits does not apply to a Gemma 4 assistant"):
        mlx_dspark.load(str(gemma), draft=str(draft), kv_bits=8)
    with pytest.raises(ValueError, match=r"this is a Gemma 4 assistant draft, not a target"):
        mlx_dspark.load(str(draft))
