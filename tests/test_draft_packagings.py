"""The DSpark packagings upstream llama.cpp reads beyond DeepSpec's layout, written with the `gguf`
writer under upstream's exact key / tensor names (and the Hugging Face variants in the exporters'
config layouts): each drafts bitwise like the same draft in DeepSpec's layout (float32), the
equivalence spelled out per case, and greedy speculative output equals plain greedy."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.models.heads.dspark.markov import draft_tokens
from mlx_dspark.testing.gguf_writer import write_gguf_draft

PROMPT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b"
HEAD_DIM = 32  # the tiny qwen3 draft's


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_pair):
    target, draft = tiny_qwen3_pair
    return target, draft, mlx_dspark.load(target, draft=draft, dtype="float32")


@pytest.fixture(scope="module")
def spark(tiny_spark_pair):
    target, draft = tiny_spark_pair
    return target, draft, mlx_dspark.load(target, draft=draft, dtype="float32")


def _load(target: Path, draft: Path):
    return mlx_dspark.load(target, draft=draft, dtype="float32")


def _features(model, n: int = 20, seed: int = 0) -> mx.array:
    width = len(model.draft.args.target_layer_ids) * model.target.args.hidden_size
    return mx.array(np.random.default_rng(seed).standard_normal((1, n, width)).astype(np.float32))


def _propose(model, *, target=None, greedy: bool = True, anchor: int = 17, n: int = 20):
    ctx = model.draft.make_cache()
    model.draft.append_context(_features(model, n), ctx)
    mx.random.seed(3)
    out = model.draft.propose(mx.array([anchor]), ctx, target=target or model.target, greedy=greedy, temperature=0.8)
    mx.eval(out.tokens, out.token_probs, out.confidence)
    return out


def _same(a, b) -> None:
    assert a.tokens.tolist() == b.tokens.tolist()
    assert np.array_equal(np.array(a.token_probs), np.array(b.token_probs))
    assert np.array_equal(np.array(a.confidence), np.array(b.confidence))
    if a.draft_probs is not None:
        assert np.array_equal(np.array(a.draft_probs), np.array(b.draft_probs))


def _lossless(model) -> None:
    for max_tokens in (5, 40):
        plain = mlx_dspark.generate(model, PROMPT, max_tokens=max_tokens, speculative=False)
        spec = mlx_dspark.generate(model, PROMPT, max_tokens=max_tokens)
        assert spec.tokens == plain.tokens
        assert spec.acceptance_lengths


def _edited_dir(source: Path, dst: Path, *, config: dict | None = None, weights=None) -> Path:
    """A copy of a DeepSpec-layout draft directory with config fields set and weights edited."""
    shutil.copytree(source, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text(encoding="utf-8"))
        cfg.update(config)
        for key in [k for k, v in config.items() if v is None]:
            del cfg[key]
        (dst / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    if weights is not None:
        tensors = {k: np.array(v) for k, v in mx.load(str(dst / "model.safetensors")).items()}
        tensors = weights(tensors)
        mx.save_safetensors(str(dst / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()})
    return dst


@pytest.mark.parametrize("family", ["qwen3", "spark"])
def test_value_attention_and_markov_scales_draft_like_the_folded_deepspec_draft(request, family, tmp_path):
    """attention.value_scale 2 == the output projection x 2; attention.scale 2/sqrt(D) == the queries x 2
    (q_norm, or the Q rows of q_k_v_proj); markov_w2.scale 2 == markov_w2 x 2 (powers of two: exact in
    float32). Both layer families."""
    target, draft, plain = request.getfixturevalue(family)
    args = plain.draft.args.layers
    gguf = write_gguf_draft(
        draft, tmp_path / "scaled.gguf", target_path=target,
        extra_keys={"dflash.attention.value_scale": 2.0, "dflash.attention.scale": 2.0 / math.sqrt(args.head_dim)},
        extra_tensors={"markov_w2.scale": np.array([2.0], np.float32)},
    )  # fmt: skip

    def fold(w):
        for name in list(w):
            if name.endswith(("self_attn.o_proj.weight", "self_attn.out_proj.weight", "self_attn.q_norm.weight", "markov_w2.weight")):
                w[name] = w[name] * 2
            elif name.endswith("self_attn.q_k_v_proj.weight"):
                q_rows = args.num_attention_heads * args.head_dim
                w[name] = np.concatenate([w[name][:q_rows] * 2, w[name][q_rows:]])
        return w

    folded = _edited_dir(draft, tmp_path / "folded", weights=fold)
    scaled_model, folded_model = _load(target, gguf), _load(target, folded)
    packaging = scaled_model.draft.args.packaging
    assert (packaging.value_scale, packaging.markov_w2_scale) == (2.0, 2.0)
    for greedy in (True, False):
        _same(_propose(scaled_model, greedy=greedy), _propose(folded_model, greedy=greedy))
    assert _propose(scaled_model).tokens.tolist() != _propose(plain).tokens.tolist() or not np.array_equal(
        np.array(_propose(scaled_model).confidence), np.array(_propose(plain).confidence)
    )
    _lossless(scaled_model)


class _ScaledEmbedding:
    """The target with its embedding rows scaled / replaced, as the draft sees it (the LM head unchanged)."""

    def __init__(self, target, *, scale: float = 1.0, rows: dict[int, mx.array] | None = None):
        self.target, self.scale, self.rows = target, scale, rows or {}

    def embed(self, ids):
        h = self.target.embed(ids)
        for i, row in self.rows.items():
            h = mx.where((ids == i)[..., None], row, h)
        return h * self.scale if self.scale != 1.0 else h

    def lm_head_logits(self, h):
        return self.target.lm_head_logits(h)


def test_embedding_scale_drafts_like_the_deepspec_draft_over_a_scaled_embedding(qwen3, tmp_path):
    target, draft, plain = qwen3
    gguf = write_gguf_draft(draft, tmp_path / "e.gguf", target_path=target, extra_keys={"dflash.embedding_scale": 3.0})
    model = _load(target, gguf)
    assert model.draft.args.packaging.embedding_scale == 3.0
    _same(_propose(model), _propose(plain, target=_ScaledEmbedding(plain.target, scale=3.0)))
    assert _propose(model).tokens.tolist() != _propose(plain).tokens.tolist()
    _lossless(model)


def test_own_token_embd_with_its_own_mask_row_embeds_the_block_with_it(qwen3, tmp_path):
    """A draft whose token_embd differs from the target's in the mask row (drafts shipping
    mask_embedding.pt): the block embeds with the draft's row; more differing rows is another target."""
    target, draft, plain = qwen3
    embed = np.array(plain.target.embedding.weight)
    mask = plain.draft.args.mask_token_id
    row = np.random.default_rng(1).standard_normal(embed.shape[1]).astype(np.float32)
    own = embed.copy()
    own[mask] = row
    gguf = write_gguf_draft(draft, tmp_path / "m.gguf", target_path=target, extra_tensors={"token_embd.weight": own})
    model = _load(target, gguf)
    _same(_propose(model), _propose(plain, target=_ScaledEmbedding(plain.target, rows={mask: mx.array(row)})))
    assert _propose(model).tokens.tolist() != _propose(plain).tokens.tolist()
    _lossless(model)
    from mlx_dspark.loading.convert import convert

    logged = []
    kept = convert(gguf, tmp_path / "kept", keep_shared=True, log=logged.append)
    _same(_propose(_load(target, kept)), _propose(model))
    convert(gguf, tmp_path / "dropped", log=logged.append)
    assert any("convert with --keep-shared" in line for line in logged)
    other = embed.copy()
    other[:40] += 1.0
    bad = write_gguf_draft(draft, tmp_path / "bad.gguf", target_path=target, extra_tensors={"token_embd.weight": other})
    with pytest.raises(ValueError, match=r"'embed_tokens.weight'.*differs from the target's embed weights in at least 40 rows \(up to 16"):
        _load(target, bad)


def _bonus_anchor_reference(plain, *, n: int = 20, anchor: int = 17):
    """DeepSpec's pieces with the bonus-anchor rule: rows 1.. of the same block are the drafts."""
    draft = plain.draft
    ctx = draft.make_cache()
    draft.append_context(_features(plain, n), ctx)
    hidden = draft.block_hidden(mx.array([anchor]), ctx, target=plain.target)[:, 1:]
    base = plain.target.lm_head_logits(hidden).astype(mx.float32)
    return draft_tokens(
        mx.array([anchor]), hidden, base, markov_head=draft.markov_head, confidence_head=draft.confidence_head,
        confidence_with_markov=True, greedy=True, temperature=1.0,
    )  # fmt: skip


@pytest.mark.parametrize("family", ["spark"])
def test_sample_from_anchor_false_spark_style_draft(request, family, tmp_path):
    target, draft, plain = request.getfixturevalue(family)
    gguf = write_gguf_draft(draft, tmp_path / "b.gguf", target_path=target, extra_keys={"dflash.sample_from_anchor": False})
    model = _load(target, gguf)
    _same(_propose(model), _bonus_anchor_reference(plain))
    _lossless(model)


def test_sample_from_anchor_false_drafts_from_row_one(qwen3, tmp_path):
    target, draft, plain = qwen3
    gguf = write_gguf_draft(draft, tmp_path / "b.gguf", target_path=target, extra_keys={"dflash.sample_from_anchor": False})
    model = _load(target, gguf)
    assert model.draft.num_drafts == plain.draft.args.block_size - 1
    out = _propose(model)
    assert out.tokens.shape == (1, plain.draft.args.block_size - 1)
    _same(out, _bonus_anchor_reference(plain))
    with pytest.raises(ValueError, match=r"num_tokens must be in \[1, 6\]"):
        model.draft.propose(mx.array([1]), model.draft.make_cache(), target=model.target, num_tokens=7)
    _lossless(model)
    # the HF EAGLE-3-style export of the same draft: layer fields nested, taps as aux ids (+ 1), and the
    # bonus-anchor block by default
    cfg = json.loads((draft / "config.json").read_text(encoding="utf-8"))
    layer_keys = [k for k in cfg if k not in ("architectures", "block_size", "mask_token_id", "markov_rank", "markov_head_type",
                                               "enable_confidence_head", "confidence_head_with_markov", "target_layer_ids")]
    eagle = {k: cfg[k] for k in cfg if k not in layer_keys and k != "target_layer_ids"}
    eagle["architectures"] = ["DSparkSpeculator"]
    for name in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
        del eagle[name]  # such exports carry none of these: read off the tensors, as upstream's converter does
    eagle["transformer_layer_config"] = {k: cfg[k] for k in layer_keys}
    eagle["aux_hidden_state_layer_ids"] = [i + 1 for i in cfg["target_layer_ids"]]
    hf = tmp_path / "eagle3"
    hf.mkdir()
    shutil.copyfile(draft / "model.safetensors", hf / "model.safetensors")
    (hf / "config.json").write_text(json.dumps(eagle), encoding="utf-8")
    eagle_model = _load(target, hf)
    assert eagle_model.draft.args.target_layer_ids == plain.draft.args.target_layer_ids
    _same(_propose(eagle_model), out)
    from mlx_dspark.loading.convert import convert

    _same(_propose(_load(target, convert(hf, tmp_path / "eagle3-mlx", log=lambda m: None))), out)
    # an explicit sample_from_anchor true keeps DeepSpec's anchor-first block
    eagle["sample_from_anchor"] = True
    (hf / "config.json").write_text(json.dumps(eagle), encoding="utf-8")
    _same(_propose(_load(target, hf)), _propose(plain))


def _d2t_ids(vocab: int, size: int) -> np.ndarray:
    return np.sort(np.random.default_rng(5).choice(vocab, size=size, replace=False)).astype(np.int64)


def _restricted_reference(plain, ids: np.ndarray, *, n: int = 20, anchor: int = 17) -> list[int]:
    """The full draft's logits (base + Markov bias) restricted to the d2t ids, step by step."""
    draft = plain.draft
    ctx = draft.make_cache()
    draft.append_context(_features(plain, n), ctx)
    hidden = draft.block_hidden(mx.array([anchor]), ctx, target=plain.target)
    base = plain.target.lm_head_logits(hidden).astype(mx.float32)
    prev, tokens = anchor, []
    for k in range(hidden.shape[1]):
        bias = draft.markov_head.markov_w2(draft.markov_head.markov_w1(mx.array([prev])))
        logits = np.array(base[0, k] + bias[0])[ids]
        prev = int(ids[int(np.argmax(logits))])
        tokens.append(prev)
    return tokens


def test_d2t_reduced_vocabulary_gguf_and_hf_draft_over_the_mapped_target_ids(qwen3, tmp_path):
    target, draft, plain = qwen3
    vocab = plain.target.args.vocab_size
    ids = _d2t_ids(vocab, 200)
    head = np.array(plain.target.lm_head.weight)[ids]
    w2 = np.array(plain.draft.markov_head.markov_w2.weight)[ids]
    gguf = write_gguf_draft(
        draft, tmp_path / "d2t.gguf", target_path=target,
        extra_tensors={"d2t": ids, "output.weight": head, "markov_w2.weight": w2},
    )  # fmt: skip
    model = _load(target, gguf)
    assert model.draft.args.packaging.draft_vocab_size == 200
    out = _propose(model)
    assert out.tokens[0].tolist() == _restricted_reference(plain, ids)
    assert set(out.tokens[0].tolist()) <= set(ids.tolist())
    sampled = _propose(model, greedy=False)
    assert sampled.draft_probs.shape == (1, 7, vocab)  # spread over the target vocabulary, zero elsewhere
    outside = np.setdiff1d(np.arange(vocab), ids)
    assert np.all(np.array(sampled.draft_probs)[..., outside] == 0)
    assert np.allclose(np.array(sampled.draft_probs).sum(-1), 1.0, atol=1e-5)
    _lossless(model)
    drawn = mlx_dspark.generate(model, PROMPT, max_tokens=24, temperature=1.0, seed=0, draft_sampling="sample")
    assert 0 < len(drawn.tokens) <= 24 and all(0 <= t < vocab for t in drawn.tokens)
    # the Hugging Face packaging: d2t as offsets (id = d2t[i] + i), draft_vocab_size, the own lm_head rows
    def reduce(w):
        w["lm_head.weight"] = head
        w["markov_head.markov_w2.weight"] = w2
        w["d2t"] = ids - np.arange(ids.size)
        w["t2d"] = np.isin(np.arange(vocab), ids)
        return w

    hf = _edited_dir(draft, tmp_path / "hf-d2t", config={"draft_vocab_size": 200}, weights=reduce)
    _same(_propose(_load(target, hf)), out)
    no_size = _edited_dir(draft, tmp_path / "hf-d2t-no-size", weights=reduce)
    with pytest.raises(ValueError, match="'d2t' tensor .* sets no draft_vocab_size"):
        _load(target, no_size)


def test_interleaved_rope_checkpoint_is_permuted_to_rotate_half(qwen3, tmp_path):
    """rope_is_neox_style false: q/k and their norms stored in interleaved order load as the same draft."""
    target, draft, plain = qwen3

    def interleave(w):
        for name in list(w):
            if name.endswith(("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight")):
                shape = w[name].shape
                # inverse of upstream's permutation: rotate-half pair (i, i + D/2) -> interleaved (2i, 2i + 1)
                w[name] = w[name].reshape(-1, 2, HEAD_DIM // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
        return w

    hf = _edited_dir(draft, tmp_path / "interleaved", config={"rope_is_neox_style": False}, weights=interleave)
    _same(_propose(_load(target, hf)), _propose(plain))
    # converted once: written in rotate-half order, and read back without a second permutation
    from mlx_dspark.loading.convert import convert

    converted = convert(hf, tmp_path / "interleaved-mlx", log=lambda m: None)
    _same(_propose(_load(target, converted)), _propose(plain))
    stored = _edited_dir(draft, tmp_path / "interleaved-flag-missing", weights=interleave)
    assert _propose(_load(target, stored)).tokens.tolist() != _propose(plain).tokens.tolist()


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh"])
def test_hidden_activation_key_picks_the_draft_mlp(qwen3, tmp_path, act):
    target, draft, plain = qwen3
    gguf = write_gguf_draft(draft, tmp_path / f"{act}.gguf", target_path=target, extra_keys={"dflash.hidden_activation": act})
    hf = _edited_dir(draft, tmp_path / act, config={"hidden_act": act})
    model = _load(target, gguf)
    assert model.draft.args.layers.hidden_act == act
    _same(_propose(model), _propose(_load(target, hf)))
    assert _propose(model).tokens.tolist() != _propose(plain).tokens.tolist()
    silu = write_gguf_draft(draft, tmp_path / "silu.gguf", target_path=target, extra_keys={"dflash.hidden_activation": "silu"})
    _same(_propose(_load(target, silu)), _propose(plain))


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"dflash.hidden_activation": "relu"}, r"key 'dflash.hidden_activation' is 'relu'; expected one of"),
        ({"dflash.logit_scale": 0.5}, r"key 'dflash.logit_scale' is 0.5; not supported: upstream's DSpark graph"),
        ({"dflash.final_logit_softcapping": 30.0}, r"key 'dflash.final_logit_softcapping' is 30; not supported"),
        ({"dflash.conv_kernel_size": 4}, r"key 'dflash.conv_kernel_size' is set but the file has no DFlash2 selector"),
    ],
)
def test_keys_we_cannot_honour_are_refused_by_name_in_one_line(qwen3, tmp_path, keys, message):
    target, draft, _ = qwen3
    gguf = write_gguf_draft(draft, tmp_path / "x.gguf", target_path=target, extra_keys=keys)
    with pytest.raises(ValueError, match=message) as e:
        _load(target, gguf)
    assert "\n" not in str(e.value)


def test_identity_values_of_the_refused_keys_are_accepted(qwen3, tmp_path):
    target, draft, plain = qwen3
    keys = {"dflash.logit_scale": 1.0, "dflash.final_logit_softcapping": 0.0, "dflash.sample_from_anchor": True}
    gguf = write_gguf_draft(draft, tmp_path / "id.gguf", target_path=target, extra_keys=keys)
    _same(_propose(_load(target, gguf)), _propose(plain))


def test_partial_rotary_gguf_draft_is_the_hf_draft_with_partial_rotary_factor(qwen3, tmp_path):
    """dflash.rope.dimension_count below head_dim (upstream writes head_dim x partial_rotary_factor)."""
    target, draft, plain = qwen3
    gguf = write_gguf_draft(draft, tmp_path / "r.gguf", target_path=target, extra_keys={"dflash.rope.dimension_count": 16})
    cfg = json.loads((draft / "config.json").read_text(encoding="utf-8"))
    rope = {**cfg["rope_parameters"], "partial_rotary_factor": 0.5}
    hf = _edited_dir(draft, tmp_path / "partial", config={"rope_parameters": rope})
    model = _load(target, gguf)
    _same(_propose(model), _propose(_load(target, hf)))
    assert _propose(model).tokens.tolist() != _propose(plain).tokens.tolist()


def test_a_draft_directory_with_mask_embedding_pt_is_refused_by_name(qwen3, tmp_path):
    target, draft, _ = qwen3
    hf = _edited_dir(draft, tmp_path / "mask-pt")
    (hf / "mask_embedding.pt").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"mask_embedding.pt: the draft's own mask embedding is a PyTorch pickle.*convert_hf_to_gguf"):
        _load(target, hf)


def test_hf_dflash_config_scales_are_the_gguf_keys(qwen3, tmp_path):
    """The z-lab / SpecForge layout: the scales nested under dflash_config, as upstream's converter reads them."""
    target, draft, _ = qwen3
    scales = {"attention_value_scale": 0.5, "input_embedding_scale": 1.5}
    hf = _edited_dir(draft, tmp_path / "nested", config={"dflash_config": scales})
    gguf = write_gguf_draft(
        draft, tmp_path / "n.gguf", target_path=target,
        extra_keys={"dflash.attention.value_scale": 0.5, "dflash.embedding_scale": 1.5},
    )  # fmt: skip
    _same(_propose(_load(target, hf)), _propose(_load(target, gguf)))
    bad = _edited_dir(draft, tmp_path / "bad-nested", config={"dflash_config": {"output_multiplier": 0.25}})
    with pytest.raises(ValueError, match=r"field 'output_multiplier' is 0.25; not supported"):
        _load(target, bad)


def test_conf_proj_without_bias_is_a_zero_bias(qwen3, tmp_path):
    """Upstream's loader takes conf_proj.bias as optional."""
    target, draft, plain = qwen3

    def zero_bias(w):
        w["confidence_head.proj.bias"] = np.zeros_like(w["confidence_head.proj.bias"])
        return w

    gguf = write_gguf_draft(draft, tmp_path / "nb.gguf", target_path=target, drop_tensors=("conf_proj.bias",))
    _same(_propose(_load(target, gguf)), _propose(_load(target, _edited_dir(draft, tmp_path / "zero-bias", weights=zero_bias))))
