"""Targets run by mlx-lm's own model classes (models/target/mlx_lm.py): llama (MiniCPM5's architecture),
gemma4_text and a MoE (qwen3_moe), each with a random qwen3-layer DSpark draft. The oracle is mlx-lm's
own `stream_generate` (what `mlx_lm.generate` runs) on the same checkpoint, loaded by `mlx_lm.load`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache

import mlx_dspark
from mlx_dspark.bench.controlled import reference_block
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.engine.proposers.base import Proposal, Proposer
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.models.target import mlx_lm as mlx_lm_target
from mlx_dspark.testing.mlx_lm_checkpoints import HYBRID_FAMILIES, MLX_LM_FAMILIES, write_tiny_mlx_lm_target
from mlx_dspark.testing.tiny import write_tiny_draft

PROMPT = [1, 5, 9, 20, 33, 7, 100, 250, 3, 64, 17, 42]
TOKENS = 210


def write_pair(root: Path, family: str) -> tuple[Path, Path]:
    target = write_tiny_mlx_lm_target(root / "target", family=family, seed=0)
    draft = write_tiny_draft(root / "draft", target_path=target, layer_family="qwen3", seed=0)
    config_file = draft / "config.json"
    config = json.loads(config_file.read_text())
    # the draft's own (qwen3) layers use default RoPE, whatever RoPE the copied target config names
    config.update(rope_theta=10000.0, rope_parameters=None)
    config.pop("final_logit_softcapping", None)  # a gemma4 target's; our DSpark packaging refuses it on a draft
    config_file.write_text(json.dumps(config))
    return target, draft


@pytest.fixture(scope="module", params=MLX_LM_FAMILIES)
def pair(request, tmp_path_factory) -> tuple[str, Path, Path]:
    return (request.param, *write_pair(tmp_path_factory.mktemp(request.param), request.param))


def mlx_lm_greedy(target: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own generate on the checkpoint (its model, its loop), end-of-sequence ids ignored."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(target))
    tokenizer.eos_token_ids = []
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]


class InjectingProposer(Proposer):
    """The real draft's proposal (its forward runs every round) replaced by the reference continuation
    with one wrong token at a random position in most rounds: partial acceptances of every length."""

    def __init__(self, inner: DraftProposer, reference: list[int], *, prompt_len: int, vocab_size: int, seed: int = 0):
        self.inner, self.reference, self.prompt_len, self.vocab_size = inner, reference, prompt_len, vocab_size
        self.tap_ids, self.block_size = inner.tap_ids, inner.block_size
        self.rng = random.Random(seed)

    def extend(self, features: mx.array) -> None:
        self.inner.extend(features)

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int) -> Proposal:
        real = self.inner.propose(anchor, position=position, num_tokens=num_tokens)
        wrong = self.rng.randrange(num_tokens) if self.rng.random() < 0.85 else None
        return Proposal(tokens=reference_block(real, self.reference, start=position - self.prompt_len + 1,
                                               num_tokens=num_tokens, wrong=wrong, vocab_size=self.vocab_size))  # fmt: skip


def test_greedy_speculation_is_mlx_lms_generate_with_partial_acceptances(pair):
    family, target, draft = pair
    reference = mlx_lm_greedy(target, PROMPT, TOKENS + 8)
    loaded = prepare_model(mlx_dspark.load(str(target), str(draft)), RunSettings(ignore_eos=True))
    assert mlx_lm_target.is_mlx_lm_target(loaded.target) and loaded.target.mlx_lm_model_type == family
    inner = DraftProposer(loaded.draft, loaded.target, greedy=True, temperature=1.0)
    proposer = InjectingProposer(inner, reference, prompt_len=len(PROMPT), vocab_size=loaded.target.args.vocab_size)
    result = mlx_dspark.generate(loaded, PROMPT, max_tokens=TOKENS, proposer=proposer)
    assert result.tokens == reference[:TOKENS]
    partial = sum(a - 1 < p for a, p in zip(result.acceptance_lengths, result.proposal_lengths))
    assert partial >= 0.6 * result.rounds, (partial, result.rounds)
    assert result.mean_acceptance_length > 2.0  # the right prefixes were accepted (not only bonus tokens)
    # and the real draft alone (random weights) still gives mlx-lm's tokens
    plain_draft = mlx_dspark.generate(loaded, PROMPT, max_tokens=40)
    assert plain_draft.tokens == reference[:40]


def test_prompt_cache_serves_the_next_turn_exactly(pair):
    _, target, draft = pair
    loaded = prepare_model(mlx_dspark.load(str(target), str(draft)), RunSettings(ignore_eos=True))
    cache = mlx_dspark.make_prompt_cache(loaded)
    first = mlx_dspark.generate(loaded, PROMPT, max_tokens=30, prompt_cache=cache)
    follow_up = PROMPT + first.tokens + [11, 12, 13]
    warm = mlx_dspark.generate(loaded, follow_up, max_tokens=30, prompt_cache=cache)
    assert warm.cached_tokens >= len(PROMPT) + 29
    assert warm.tokens == mlx_dspark.generate(loaded, follow_up, max_tokens=30).tokens


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_targets_load_and_their_plain_decoding_is_mlx_lms_generate(tmp_path, family):
    """qwen3_5 (under its multimodal wrapper), lfm2, nemotron_h: the probe passes and the tapped forward
    is mlx-lm's; speculation on them needs their recurrent caches rolled back (models/cache.trim_caches)."""
    target = write_tiny_mlx_lm_target(tmp_path / family, family=family)
    loaded = prepare_model(mlx_dspark.load(str(target)), RunSettings(ignore_eos=True))
    assert loaded.target.args.hidden_size == 128 and loaded.target.args.num_hidden_layers == 4
    assert mlx_dspark.generate(loaded, PROMPT, max_tokens=40, speculative=False).tokens == mlx_lm_greedy(target, PROMPT, 40)
    cache = loaded.target.make_cache()
    logits, features = loaded.target(mx.array([PROMPT]), cache=cache, tap_ids=(0, 2))
    assert features.shape == (1, len(PROMPT), 256) and logits.shape == (1, len(PROMPT), 384)


def test_a_drafts_head_copy_is_compared_with_a_wrapped_models_head(tmp_path):
    """qwen3_5 keeps its untied head under language_model: a draft's lm_head copy is checked against it."""
    from mlx_dspark.loading.pair import check_shared_tensors

    target = mlx_dspark.load(str(write_tiny_mlx_lm_target(tmp_path / "q", family="qwen3_5"))).target
    head = target.language_model.lm_head.weight
    assert target.output_head is target.language_model.lm_head
    assert check_shared_tensors({"lm_head.weight": head, "embed_tokens.weight": target.embedding.weight}, target, draft_source="d") == {}
    with pytest.raises(ValueError, match="'lm_head.weight' differs from the target's head"):
        check_shared_tensors({"lm_head.weight": head + 0.5}, target, draft_source="d")


def test_features_are_the_decoder_layers_outputs(tmp_path):
    """llama: the tapped features are each mlx-lm layer's output, run by hand here."""
    from mlx_lm.models.base import create_attention_mask

    target = write_tiny_mlx_lm_target(tmp_path / "llama", family="llama")
    model = mlx_dspark.load(str(target)).target
    ids = mx.array([PROMPT])
    h = model.model.embed_tokens(ids)
    expected = {-1: h}
    mask = create_attention_mask(h, None)
    for i, layer in enumerate(model.layers[:-1]):
        h = layer(h, mask, cache=None)
        expected[i] = h
    logits, features = model(ids, tap_ids=(2, -1, 0))
    assert mx.array_equal(features, mx.concatenate([expected[2], expected[-1], expected[0]], axis=-1)).item()
    last, none = model(ids, last_only=True)
    assert none is None and last.shape == (1, 1, logits.shape[-1])
    assert mx.allclose(last, logits[:, -1:], atol=1e-5).item()


def test_sampled_speculation_runs_seeded_on_gemma4(tmp_path):
    target, draft = write_pair(tmp_path, "gemma4_text")
    loaded = prepare_model(mlx_dspark.load(str(target), str(draft)), RunSettings(ignore_eos=True))
    runs = [mlx_dspark.generate(loaded, PROMPT, max_tokens=60, temperature=0.8, seed=3).tokens for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 60
    assert runs[0] != mlx_dspark.generate(loaded, PROMPT, max_tokens=60, temperature=0.8, seed=4).tokens


def test_probe_refuses_a_forward_it_cannot_reproduce(tmp_path):
    from mlx_lm.models import llama

    class Model(llama.Model):  # logits shifted by the input ids: not a head of the final hidden state
        def __call__(self, inputs, cache=None, input_embeddings=None):
            return super().__call__(inputs, cache, input_embeddings) + inputs[..., None].astype(mx.float32)

    class Looped(llama.Model):  # the backbone runs layer 0 twice (a weight-shared loop)
        def __call__(self, inputs, cache=None, input_embeddings=None):
            h = self.model.embed_tokens(inputs)
            h = self.layers[0](h, "causal" if inputs.shape[1] > 1 else None, None)
            return super().__call__(inputs, cache, input_embeddings=h)

    config = json.loads((write_tiny_mlx_lm_target(tmp_path / "t", family="llama") / "config.json").read_text())
    for broken, why in ((Model, "not a function of the final hidden state"), (Looped, "not each called once")):
        model = mlx_lm_target.from_config(config, model_class=broken)
        with pytest.raises(ValueError, match=f"model_type 'llama'.*{why}"):
            mlx_lm_target.probe_target(model)


def test_bad_targets_are_one_line_naming_the_field(tmp_path):
    target = write_tiny_mlx_lm_target(tmp_path / "t", family="llama")
    config = json.loads((target / "config.json").read_text())
    config.update(model_type="no_such_family", architectures=["NoSuchForCausalLM"])
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: model_type 'no_such_family' is not a model mlx-lm implements"):
        mlx_dspark.load(str(target))
    config.pop("model_type")
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: field 'model_type' is missing"):
        mlx_dspark.load(str(target))
    config.update(model_type="llama")
    (target / "config.json").write_text(json.dumps(config))
    quantized = mlx_dspark.load(str(target), kv_bits=8).target.make_cache()  # any family: mlx-lm's quantized cache
    assert all(isinstance(c, QuantizedKVCache) and c.bits == 8 for c in quantized)


def test_a_draft_that_does_not_fit_the_target_is_refused(tmp_path):
    target = write_tiny_mlx_lm_target(tmp_path / "t", family="qwen3_moe")
    wide = write_tiny_mlx_lm_target(tmp_path / "wide", family="llama", hidden_size=256, intermediate_size=512)
    draft = write_tiny_draft(tmp_path / "d", target_path=wide, layer_family="qwen3")
    with pytest.raises(ValueError, match=r"config.json: hidden_size is 256 but the target .* has 128"):
        mlx_dspark.load(str(target), str(draft))
    draft = write_tiny_draft(tmp_path / "d2", target_path=target, layer_family="qwen3", target_layer_ids=[0, 3])
    with pytest.raises(ValueError, match=r"target_layer_ids \[0, 3\] has \[3\] outside \[-1, 2\]"):
        mlx_dspark.load(str(target), str(draft))
