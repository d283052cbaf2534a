"""DFlash 2 drafts (issue 35.1) in z-lab's Hugging Face layout: they load (no longer refused), their
greedy proposals are an independent NumPy restatement's (tests/dflash2_reference.py), a sampled
proposal reports the selector's q over its K candidates, and speculative greedy output is plain
decoding's, token for token."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

import mlx_dspark
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.models.heads.dspark.dflash2 import DFlash2Draft
from mlx_dspark.models.target.lm_head import target_head
from mlx_dspark.testing.dflash2_tiny import write_dflash2_draft
from mlx_dspark.testing.tiny import write_tiny_draft
from tests.dflash2_reference import DFlash2Reference
from tests.engine_helpers import make_draft

PROMPT = [1, 5, 9, 20, 33, 7, 100, 250, 3, 64, 17, 42]


@pytest.fixture(scope="module", params=[{}, {"output_multiplier": 0.7, "softcap": 20.0}], ids=["plain", "scaled_capped"])
def dflash2_pair(request, tiny_qwen3_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2")
    deepspec = write_tiny_draft(root / "deepspec", target_path=tiny_qwen3_target, seed=3)
    draft = write_dflash2_draft(deepspec, root / "dflash2", seed=4, **request.param)
    return tiny_qwen3_target, draft, mlx_dspark.load(str(tiny_qwen3_target), draft=str(draft), dtype="float32")


def _reference(draft_dir) -> DFlash2Reference:
    config = json.loads((draft_dir / "config.json").read_text())
    weights = {}
    for f in sorted(draft_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return DFlash2Reference({**config, **config["dflash_config"]}, weights)


def test_greedy_proposals_are_the_reference_selectors_path(dflash2_pair):
    _, draft_dir, pair = dflash2_pair
    draft = pair.draft
    assert isinstance(draft, DFlash2Draft) and draft.args.packaging.first_draft_row == 1
    reference = _reference(draft_dir)
    embedding = np.array(pair.target.embedding.weight)
    lm_head = np.array(target_head(pair.target).weight)
    width = len(draft.args.target_layer_ids) * pair.target.args.hidden_size
    features = np.random.default_rng(0).standard_normal((1, 20, width)).astype(np.float32)
    ctx = draft.make_cache()
    draft.append_context(mx.array(features), ctx)
    for anchor in (17, 250, 3):
        out = draft.propose(mx.array([anchor]), ctx, target=pair.target)
        want = reference.select(features[0], anchor, embedding=embedding, lm_head=lm_head, n=draft.num_drafts)
        assert out.tokens[0].tolist() == want["tokens"]
        q = np.exp(want["scores"][0] - want["scores"][0].max())
        np.testing.assert_allclose(float(out.token_probs[0, 0]), (q / q.sum()).max(), rtol=1e-4)


def test_a_sampled_proposal_reports_the_selectors_q_over_its_candidates(dflash2_pair):
    _, draft_dir, pair = dflash2_pair
    draft = pair.draft
    width = len(draft.args.target_layer_ids) * pair.target.args.hidden_size
    features = np.random.default_rng(1).standard_normal((1, 12, width)).astype(np.float32)
    ctx = draft.make_cache()
    draft.append_context(mx.array(features), ctx)
    mx.random.seed(5)
    out = draft.propose(mx.array([9]), ctx, target=pair.target, greedy=False, temperature=0.8)
    reference = _reference(draft_dir)
    embedding, lm_head = np.array(pair.target.embedding.weight), np.array(target_head(pair.target).weight)
    first = reference.select(features[0], 9, embedding=embedding, lm_head=lm_head, n=1)
    probs = np.array(out.draft_probs[0, 0])
    support = set(np.nonzero(probs)[0].tolist())
    assert support <= set(first["candidates"][0].tolist()) and np.isclose(probs.sum(), 1.0, atol=1e-5)
    q = np.exp((first["scores"][0] - first["scores"][0].max()) / 0.8)
    np.testing.assert_allclose(probs[first["candidates"][0]], q / q.sum(), rtol=1e-4, atol=1e-7)
    assert int(out.tokens[0, 0]) in support  # the draw is one of the K


def test_speculative_greedy_with_a_dflash2_draft_is_plain_decoding(dflash2_pair):
    pair = prepare_model(dflash2_pair[2], RunSettings(ignore_eos=True))
    plain = mlx_dspark.generate(pair, PROMPT, max_tokens=200, speculative=False)
    spec = mlx_dspark.generate(pair, PROMPT, max_tokens=200)
    assert spec.tokens == plain.tokens and len(spec.tokens) == 200
    assert spec.rounds < 200 and spec.acceptance_lengths  # it drafted, and some drafts were kept


def test_penalties_inside_the_round_keep_a_dflash2_pair_lossless(dflash2_pair):
    """The engine's logits processing reaches the selector (its candidates are taken from the processed
    logits), so a penalised greedy run is plain decoding's; the pair batches (tests/test_batch_heads.py)."""
    from mlx_dspark.models.packed.forward import packing_problem

    pair = prepare_model(dflash2_pair[2], RunSettings(ignore_eos=True))
    penalties = dict(repetition_penalty=1.7, presence_penalty=0.8, penalty_last_n=4)
    plain = mlx_dspark.generate(pair, PROMPT, max_tokens=80, speculative=False, **penalties)
    spec = mlx_dspark.generate(pair, PROMPT, max_tokens=80, **penalties)
    assert spec.tokens == plain.tokens and spec.rounds < 80
    assert packing_problem(pair) is None


@pytest.mark.parametrize("drafting", ["sample", "greedy"])
def test_sampled_rounds_with_a_dflash2_draft_keep_the_target_distribution(drafting):
    """Sampled drafts come from the selector's q over its K candidates (zero elsewhere), and the verify's
    residual is taken against that q: thousands of short runs fit the target's exact distribution."""
    from tests.engine_helpers import make_target
    from tests.test_lossless_sampling import SAMPLERS, VOCAB, chi_square_p_value, exact_distribution, marginals, sample_runs, to_array

    from mlx_dspark.engine.proposers.dspark import DraftProposer

    target = make_target("qwen3", seed=5, vocab_size=VOCAB, layers=4, embedding_scale=0.5)
    fields = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=4, selector_top_k=4)
    draft = make_draft(target, seed=6, dflash2=fields)
    assert isinstance(draft, DFlash2Draft)
    sampler = SAMPLERS["temperature"]
    exact = exact_distribution(target, sampler, 3)
    outcomes = sample_runs(
        target, sampler, lambda: DraftProposer(draft, target, greedy=drafting == "greedy", temperature=sampler.temperature),
        length=3, seed=99,
    )  # fmt: skip
    counts = to_array(outcomes, 3)
    assert outcomes.stats["accepted"] > 0 and outcomes.stats["all_accepted"] < outcomes.stats["rounds"]
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > 1e-4
    for observed, expected in zip(marginals(counts), marginals(exact)):
        assert chi_square_p_value(observed, expected) > 1e-4


def test_a_dflash2_gguf_is_the_same_draft_as_its_hugging_face_files(tiny_qwen3_target, tmp_path):
    """llama.cpp's `dflash` GGUF with the DFlash 2 keys and tensors (DRAFTERS.md section 1) loads as the
    z-lab file it was written from: the same parameters, the same greedy proposals, lossless output."""
    from mlx.utils import tree_flatten

    from mlx_dspark.testing.gguf_writer import write_gguf_draft

    deepspec = write_tiny_draft(tmp_path / "deepspec", target_path=tiny_qwen3_target, seed=3)
    hf = write_dflash2_draft(deepspec, tmp_path / "dflash2", seed=4, output_multiplier=0.7, softcap=20.0)
    config = json.loads((hf / "config.json").read_text())["dflash_config"]
    weights = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    extra = {"selector_predecessor.weight": weights["candidate_selector.predecessor_codebook"],
             "selector_successor.weight": weights["candidate_selector.successor_codebook"],
             "selector_hidden.weight": weights["candidate_selector.hidden_projection.weight"]}  # fmt: skip
    for name, array in weights.items():
        for ours, theirs in (("attention_conv", "attn"), ("mlp_conv", "ffn")):
            if f".{ours}." in name:
                layer = name.split(".")[1]
                kind = "base" if name.endswith("base_kernel") else "proj.weight"
                extra[f"blk.{layer}.{theirs}_conv_{kind}"] = array
    keys = {f"dflash.{k}": config[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    keys.update({"dflash.logit_scale": 0.7, "dflash.final_logit_softcapping": 20.0, "dflash.has_confidence_head": False})
    gguf = write_gguf_draft(deepspec, tmp_path / "d.gguf", target_path=tiny_qwen3_target, extra_keys=keys, extra_tensors=extra,
                            drop_tensors=("markov_w1.weight", "markov_w2.weight", "markov_w2.scale", "conf_proj.weight", "conf_proj.bias"))
    from_gguf = mlx_dspark.load(str(tiny_qwen3_target), draft=str(gguf), dtype="float32")
    from_hf = mlx_dspark.load(str(tiny_qwen3_target), draft=str(hf), dtype="float32")
    assert isinstance(from_gguf.draft, DFlash2Draft) and from_gguf.draft.args.dflash2 == from_hf.draft.args.dflash2
    ours, theirs = dict(tree_flatten(from_gguf.draft.parameters())), dict(tree_flatten(from_hf.draft.parameters()))
    assert set(ours) == set(theirs)
    for name in ours:
        np.testing.assert_array_equal(np.array(ours[name]), np.array(theirs[name]), err_msg=name)
    from_gguf, from_hf = (prepare_model(m, RunSettings(ignore_eos=True)) for m in (from_gguf, from_hf))
    spec = mlx_dspark.generate(from_gguf, PROMPT, max_tokens=64, max_draft_tokens=from_gguf.draft.num_drafts)
    assert spec.tokens == mlx_dspark.generate(from_hf, PROMPT, max_tokens=64, speculative=False).tokens
    assert spec.rounds < 64 and spec.tokens == mlx_dspark.generate(from_hf, PROMPT, max_tokens=64, max_draft_tokens=from_hf.draft.num_drafts).tokens


@pytest.mark.parametrize("fast_forward", [True, False], ids=["fast_forward", "no_fast_forward"])
def test_constrained_generation_with_a_dflash2_draft_is_plain_constrained_decoding(dflash2_pair, fast_forward):
    """A JSON schema and a regex with forced runs: the grammar's mask reaches the selector's candidates
    (masked draft) or not (unmasked), the forced runs ride the block or not; the tokens are plain decoding's."""
    from mlx_dspark.engine.logits.constraints import Constraint

    pair = dflash2_pair[2]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}  # fmt: skip
    for constraint in (Constraint.json_schema(json.dumps(schema)), Constraint.regex(r"The answer is [0-9]{1,3}\. Done")):
        plain = mlx_dspark.generate(pair, "hello", constraint=constraint, max_tokens=40, speculative=False)
        for mask_draft in (True, False):
            spec = mlx_dspark.generate(pair, "hello", constraint=constraint, max_tokens=40, mask_draft=mask_draft,
                                       fast_forward=fast_forward, max_draft_tokens=pair.draft.num_drafts)  # fmt: skip
            assert spec.tokens == plain.tokens and spec.rounds < len(plain.tokens), (constraint.kind, mask_draft)
