"""The DSpark draft against an independent NumPy reference (tests/dspark_reference.py), both families.

Float32 MLX vs float64 NumPy on tiny random drafts; the context is appended incrementally in the MLX
draft (cached, windowed) and recomputed from all features by the reference each round.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dspark.loading.checkpoint import Checkpoint, read_checkpoint
from mlx_dspark.models.caches.draft_context import ContextCache
from mlx_dspark.loading.load import build_draft
from mlx_dspark.models.heads.dspark.model import DraftArgs, DSparkDraft
from tests.dspark_reference import ReferenceDraft, log_softmax

TOL = dict(rtol=1e-5, atol=1e-5)
CHUNKS = [3, 1, 8, 5, 2, 7, 4, 6, 1, 8]  # context positions appended before each round (45 in all)


def qwen3_config(**overrides) -> dict:
    config = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 48,
        "vocab_size": 40,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "use_sliding_window": True,
        "block_size": 7,
        "target_layer_ids": [0, 2, 3],
        "mask_token_id": 39,
        "markov_rank": 6,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 5,  # shorter than the block: later block queries see fewer context positions
    }
    config.update(overrides)
    return config


def spark_config(**overrides) -> dict:
    config = {
        "architectures": ["Spark2_5DSparkModel"],
        "model_type": "spark2_5",
        "hidden_size": 24,  # != heads x head_dim (32), as the real 4B
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 40,
        "vocab_size": 40,
        "rms_norm_eps": 1e-6,
        "hidden_act": "gelu",
        "rope_parameters": {
            "sliding_attention": {"rope_theta": 10000.0, "partial_rotary_factor": 1.0},
            "full_attention": {"rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
        },
        "block_size": 7,
        "target_layer_ids": [1, 3],
        "mask_token_id": 38,
        "markov_rank": 5,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 11,
    }
    config.update(overrides)
    return config


class StandInTarget:
    """The two things the draft uses from its target: the embedding and the LM head."""

    def __init__(self, embedding: np.ndarray, lm_head: np.ndarray):
        self.embedding = mx.array(embedding.astype(np.float32))
        self.lm_head = mx.array(lm_head.astype(np.float32))

    def embed(self, ids: mx.array) -> mx.array:
        return self.embedding[ids]

    def lm_head_logits(self, h: mx.array) -> mx.array:
        return h @ self.lm_head.T


def random_draft(config: dict, seed: int) -> tuple[DSparkDraft, dict[str, np.ndarray]]:
    """A draft with every tensor random (norm weights around 1), and the same weights as NumPy.

    The test configs' `model_type` names the layer family (a loaded draft's comes from its tensors)."""
    draft = DSparkDraft(DraftArgs.from_dict(config, family=config["model_type"]))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in tree_flatten(draft.parameters()):
        if name.endswith("norm.weight"):
            array = 1.0 + 0.2 * rng.standard_normal(value.shape)
        elif name.endswith("markov_w1.weight") or name.endswith("markov_w2.weight"):
            array = 0.7 * rng.standard_normal(value.shape)
        else:
            array = rng.standard_normal(value.shape) / math.sqrt(value.shape[-1])
        weights[name] = array.astype(np.float32)
    draft.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return draft, weights


def random_target(config: dict, seed: int) -> tuple[StandInTarget, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed + 100)
    shape = (config["vocab_size"], config["hidden_size"])
    embedding = rng.standard_normal(shape).astype(np.float32)
    lm_head = (rng.standard_normal(shape) / math.sqrt(shape[1]) * 3).astype(np.float32)
    return StandInTarget(embedding, lm_head), embedding, lm_head


def random_features(config: dict, batch: int, length: int, seed: int) -> np.ndarray:
    width = len(config["target_layer_ids"]) * config["hidden_size"]
    return np.random.default_rng(seed + 200).standard_normal((batch, length, width)).astype(np.float32)


def check_rounds(draft, reference, target, embedding, lm_head, features, *, chunks, seed) -> None:
    """Append `chunks` positions at a time; after each append, draft and reference must agree."""
    rng = np.random.default_rng(seed + 300)
    batch = features.shape[0]
    vocab = embedding.shape[0]
    ctx = draft.make_cache()
    done = 0
    for n in chunks:
        draft.append_context(mx.array(features[:, done : done + n]), ctx)
        done += n
        assert all(c.offset == done for c in ctx)
        anchor = rng.integers(0, vocab, size=batch)
        proposal = draft.propose(mx.array(anchor, dtype=mx.int32), ctx, target=target)
        base = target.lm_head_logits(draft.block_hidden(mx.array(anchor, dtype=mx.int32), ctx, target=target))
        # Sampled at T = 1, each reported distribution is softmax(logits(k)) given the tokens drawn.
        sampled = draft.propose(mx.array(anchor, dtype=mx.int32), ctx, target=target, greedy=False, temperature=1.0)
        for b in range(batch):
            ref = reference.draft(features[b, :done], int(anchor[b]), embedding=embedding, lm_head=lm_head)
            np.testing.assert_allclose(np.array(base[b]), ref["base_logits"], **TOL)
            np.testing.assert_array_equal(np.array(proposal.tokens[b]), ref["tokens"])
            np.testing.assert_allclose(np.array(proposal.token_probs[b]), ref["token_probs"], **TOL)
            if ref["confidence"] is None:
                assert proposal.confidence is None
            else:
                np.testing.assert_allclose(np.array(proposal.confidence[b]), ref["confidence"], **TOL)
            drawn = list(np.array(sampled.tokens[b]))
            ref = reference.draft(features[b, :done], int(anchor[b]), embedding=embedding, lm_head=lm_head, tokens=drawn)
            np.testing.assert_allclose(np.array(sampled.draft_probs[b]), np.exp(log_softmax(ref["logits"])), **TOL)
        assert proposal.draft_probs is None


CASES = [
    ("qwen3", "vanilla", True),
    ("qwen3", "gated", False),
    ("qwen3", "rnn", True),
    ("spark2_5", "vanilla", False),
    ("spark2_5", "gated", True),
    ("spark2_5", "rnn", False),
]


@pytest.mark.parametrize("family,head_type,with_markov", CASES)
def test_greedy_draft_matches_reference_over_incremental_rounds(family, head_type, with_markov):
    make = qwen3_config if family == "qwen3" else spark_config
    config = make(markov_head_type=head_type, confidence_head_with_markov=with_markov)
    draft, weights = random_draft(config, seed=1)
    target, embedding, lm_head = random_target(config, seed=1)
    features = random_features(config, batch=2, length=sum(CHUNKS), seed=1)
    reference = ReferenceDraft(config, weights)
    check_rounds(draft, reference, target, embedding, lm_head, features, chunks=CHUNKS, seed=1)


@pytest.mark.parametrize("make", [qwen3_config, spark_config])
def test_draft_without_markov_or_confidence_head_matches_reference(make):
    config = make(markov_rank=0, enable_confidence_head=False, layer_types=["full_attention"] * 3)
    config.pop("markov_head_type")
    config.pop("confidence_head_with_markov")
    draft, weights = random_draft(config, seed=2)
    assert not any(k.startswith(("markov_head", "confidence_head")) for k in weights)
    target, embedding, lm_head = random_target(config, seed=2)
    features = random_features(config, batch=1, length=12, seed=2)
    check_rounds(draft, ReferenceDraft(config, weights), target, embedding, lm_head, features, chunks=[4, 8], seed=2)


@pytest.mark.parametrize("window", [1, 2, 7, 8, 9])
def test_window_edges_match_reference(window):
    # 1: only the block is visible; 7..9: the block's last query sees no / one / two context positions.
    config = qwen3_config(sliding_window=window, markov_head_type="gated")
    draft, weights = random_draft(config, seed=8)
    target, embedding, lm_head = random_target(config, seed=8)
    features = random_features(config, batch=1, length=21, seed=8)
    check_rounds(draft, ReferenceDraft(config, weights), target, embedding, lm_head, features, chunks=[3, 9, 1, 8], seed=8)


def test_fewer_tokens_compute_the_same_leading_draft():
    config = qwen3_config(markov_head_type="rnn")
    draft, _ = random_draft(config, seed=3)
    target, *_ = random_target(config, seed=3)
    ctx = draft.make_cache()
    draft.append_context(mx.array(random_features(config, batch=2, length=9, seed=3)), ctx)
    anchor = mx.array([4, 17], dtype=mx.int32)
    full = draft.propose(anchor, ctx, target=target)
    short = draft.propose(anchor, ctx, target=target, num_tokens=3)
    assert short.tokens.shape == (2, 3) and short.confidence.shape == (2, 3) and short.token_probs.shape == (2, 3)
    np.testing.assert_array_equal(np.array(short.tokens), np.array(full.tokens[:, :3]))
    np.testing.assert_allclose(np.array(short.token_probs), np.array(full.token_probs[:, :3]), **TOL)
    np.testing.assert_allclose(np.array(short.confidence), np.array(full.confidence[:, :3]), **TOL)
    for bad in (0, 8):
        with pytest.raises(ValueError, match="num_tokens"):
            draft.propose(anchor, ctx, target=target, num_tokens=bad)


def test_sliding_context_stays_within_window_over_a_long_run():
    config = qwen3_config(
        hidden_size=16, num_hidden_layers=2, head_dim=4, intermediate_size=16, target_layer_ids=[1],
        layer_types=["sliding_attention", "full_attention"], sliding_window=6,
    )
    draft, weights = random_draft(config, seed=4)
    target, embedding, lm_head = random_target(config, seed=4)
    features = random_features(config, batch=1, length=3200, seed=4)
    rng = np.random.default_rng(4)
    ctx = draft.make_cache()
    sliding, full = ctx
    done = 0
    while done < 3000:
        n = int(rng.integers(1, 9))
        draft.append_context(mx.array(features[:, done : done + n]), ctx)
        done += n
        mx.eval(sliding.keys, sliding.values, full.keys, full.values)
        assert sliding.length <= config["sliding_window"] - 1
        assert sliding.capacity <= config["sliding_window"] + ContextCache.step
        assert full.length == done
    # A prefill-sized append larger than the window keeps only the last window - 1 positions.
    draft.append_context(mx.array(features[:, done : done + 100]), ctx)
    done += 100
    assert sliding.length == 5 and sliding.start == done - 5 and full.length == done
    anchor = 7
    proposal = draft.propose(mx.array([anchor], dtype=mx.int32), ctx, target=target)
    ref = ReferenceDraft(config, weights).draft(features[0, :done], anchor, embedding=embedding, lm_head=lm_head)
    np.testing.assert_array_equal(np.array(proposal.tokens[0]), ref["tokens"])
    np.testing.assert_allclose(np.array(proposal.token_probs[0]), ref["token_probs"], **TOL)


def test_sampled_drafts_follow_the_distributions_they_report():
    temperature = 1.3
    config = spark_config(markov_head_type="gated")
    draft, weights = random_draft(config, seed=5)
    target, embedding, lm_head = random_target(config, seed=5)
    features = random_features(config, batch=1, length=20, seed=5)
    rows, anchor = 2000, 9
    ctx = draft.make_cache()
    draft.append_context(mx.broadcast_to(mx.array(features), (rows, *features.shape[1:])), ctx)
    anchors = mx.full((rows,), anchor, dtype=mx.int32)
    mx.random.seed(123)
    proposal = draft.propose(anchors, ctx, target=target, greedy=False, temperature=temperature)
    tokens, probs = np.array(proposal.tokens), np.array(proposal.draft_probs)
    assert probs.shape == (rows, 7, 40)
    # x(1) is drawn from softmax(logits(1) / T), the same for every row.
    reference = ReferenceDraft(config, weights)
    first = np.exp(log_softmax(reference.draft(features[0], anchor, embedding=embedding, lm_head=lm_head)["logits"][0] / temperature))
    assert first.max() < 0.8  # a spread-out distribution, so the frequency check can fail
    np.testing.assert_allclose(probs[:, 0], np.broadcast_to(first, probs[:, 0].shape), **TOL)
    freq = np.bincount(tokens[:, 0], minlength=40) / rows
    np.testing.assert_allclose(freq, first, atol=0.04)
    # Later positions: each row's reported distribution is the reference's given its own earlier draws.
    for b in range(5):
        ref = reference.draft(features[0], anchor, embedding=embedding, lm_head=lm_head, tokens=list(tokens[b]))
        np.testing.assert_allclose(probs[b], np.exp(log_softmax(ref["logits"] / temperature)), **TOL)
        np.testing.assert_allclose(np.array(proposal.token_probs[b]), ref["token_probs"], **TOL)
        np.testing.assert_allclose(np.array(proposal.confidence[b]), ref["confidence"], **TOL)
    # The caller's seed reproduces the draws.
    mx.random.seed(123)
    again = draft.propose(anchors, ctx, target=target, greedy=False, temperature=temperature)
    np.testing.assert_array_equal(np.array(again.tokens), tokens)
    with pytest.raises(ValueError, match="temperature"):
        draft.propose(anchors, ctx, target=target, greedy=False, temperature=0.0)


# -- loading ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["draft", "draft-gated", "draft-rnn"])
def test_deepspec_fixture_loads_strictly_and_matches_reference(shared_fixtures, name):
    import json

    from safetensors.numpy import load_file

    root = shared_fixtures / "deepspec-tiny"
    config = json.loads((root / name / "config.json").read_text())
    draft, shared = build_draft(read_checkpoint(root / name))
    assert draft.args.family == "qwen3" and set(shared) == {"embed_tokens.weight", "lm_head.weight"}
    file = root / name / "model.safetensors"
    target_weights = load_file(str(root / "target" / "model.safetensors"))
    embedding, lm_head = target_weights["model.embed_tokens.weight"], target_weights["lm_head.weight"]
    weights = load_file(str(file))
    np.testing.assert_array_equal(weights["embed_tokens.weight"], embedding)  # the copy the draft shares
    target = StandInTarget(embedding, lm_head)
    reference = ReferenceDraft(config, weights)
    features = random_features(config, batch=1, length=28, seed=6)
    check_rounds(draft, reference, target, embedding, lm_head, features, chunks=[2, 9, 5, 8, 4], seed=6)


def in_memory(config: dict, weights: dict[str, mx.array]) -> Checkpoint:
    """A checkpoint as any reader hands it to the loader: config, weights, where each came from."""
    return Checkpoint(
        config=config, weights=weights, origin=dict.fromkeys(weights, "model.safetensors"),
        path=Path("draft"), config_source="draft/config.json",
    )  # fmt: skip


def test_spark_layout_strict_loading_names_missing_and_unexpected_tensors():
    _, weights = random_draft(spark_config(markov_head_type="rnn"), seed=7)
    names = set(weights)
    assert {"layers.0.self_attn.q_k_v_proj.weight", "layers.0.self_attn.g_proj.weight",
            "layers.0.self_attn.out_proj.weight", "markov_head.joint_proj.bias"} <= names
    bad = {k: mx.array(v) for k, v in weights.items() if k != "layers.1.self_attn.g_proj.weight"}
    bad["layers.1.self_attn.q_norm.weight"] = mx.zeros((8,))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['layers.1.self_attn.g_proj.weight'\].*unexpected tensor\(s\) layers.1.self_attn.q_norm.weight \(in model.safetensors\)"):
        build_draft(in_memory(spark_config(markov_head_type="rnn"), bad))
    wrong = {k: mx.array(v) for k, v in weights.items()}
    wrong["markov_head.joint_proj.weight"] = mx.zeros((15, 40))
    with pytest.raises(ValueError, match="markov_head.joint_proj.weight"):
        build_draft(in_memory(spark_config(markov_head_type="rnn"), wrong))
    shared = {"embedding.weight": mx.zeros((40, 24)), "embed_tokens.weight": mx.zeros((40, 24)), "lm_head.weight": mx.zeros((40, 24))}
    draft, kept = build_draft(in_memory(spark_config(markov_head_type="rnn"), {**{k: mx.array(v) for k, v in weights.items()}, **shared}))
    assert set(kept) == set(shared) and draft.args.family == "spark2_5"


def test_tiny_writer_spark_draft_loads_strictly(tiny_spark_pair):
    _, path = tiny_spark_pair
    draft, shared = build_draft(read_checkpoint(path))
    assert draft.args.family == "spark2_5" and set(shared) == {"embedding.weight"}


# -- config -----------------------------------------------------------------------------------------


def test_draft_args_name_missing_and_bad_fields():
    config = qwen3_config()
    del config["markov_rank"]
    with pytest.raises(ValueError, match="d/config.json.*markov_rank"):
        DraftArgs.from_dict(config, family="qwen3", source="d/config.json")
    with pytest.raises(ValueError, match="markov_head_type.*'lstm'"):
        DraftArgs.from_dict(qwen3_config(markov_head_type="lstm"), family="qwen3")
    with pytest.raises(ValueError, match="layer_types"):
        DraftArgs.from_dict(qwen3_config(layer_types=["full_attention"]), family="qwen3")
    with pytest.raises(ValueError, match="rope_parameters.*full_attention"):
        DraftArgs.from_dict(spark_config(rope_parameters={"sliding_attention": {"rope_theta": 1e4}}), family="spark2_5")
    with pytest.raises(ValueError, match="confidence_head_with_markov"):
        DraftArgs.from_dict(qwen3_config(markov_rank=0), family="qwen3")
    with pytest.raises(ValueError, match="gate_attn_act_mode"):
        DraftArgs.from_dict(spark_config(gate_attn_act_mode="softmax"), family="spark2_5")
    # As transformers' Qwen3Config (which DeepSpec's draft reads): no window without use_sliding_window.
    no_window = DraftArgs.from_dict(qwen3_config(use_sliding_window=False), family="qwen3")
    assert [no_window.layer_window(i) for i in range(3)] == [None, None, None]
    draft = DSparkDraft(DraftArgs.from_dict(spark_config(), family="spark2_5"))
    ropes = [(layer.self_attn.rope.base, layer.self_attn.rope.dims) for layer in draft.layers]
    assert ropes == [(10000.0, 8), (5000000.0, 4), (10000.0, 8)]
    assert [draft.args.layer_window(i) for i in range(3)] == [11, None, 11]
