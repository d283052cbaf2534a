"""DeepSpec's Gemma 4 DSpark draft (`deepspec/modeling/dspark/gemma4/modeling.py`): loaded from a tiny
checkpoint in DeepSpec's exact layout, checked against a float64 NumPy re-statement of that file, and
run losslessly with a target."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.testing.draft_layouts import write_gemma4_draft
from mlx_dspark.testing.tiny import _read_hf_weights


def _rms(x, weight, eps):
    out = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return out if weight is None else out * weight  # Gemma4RMSNorm: no +1 offset


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _rope(x, positions, *, theta, head_dim, factor, kind):
    """transformers' Gemma 4 RoPE over the whole head (rotate-half); proportional: only the first
    int(factor * head_dim // 2) pairs turn, at theta ** (-2i / head_dim); x (n, heads, D)."""
    half = head_dim // 2
    turning = int(factor * head_dim // 2) if kind == "proportional" else half
    inv = np.zeros(half)
    inv[:turning] = 1.0 / theta ** (np.arange(0, 2 * turning, 2) / head_dim)
    ang = np.concatenate([positions[:, None] * inv, positions[:, None] * inv], axis=-1)[:, None, :]
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def reference_proposal(config: dict, w: dict, features: np.ndarray, anchor: int, *, embed, head) -> tuple[list, list, list]:
    """Greedy drafts and confidences of one block at p = len(features), as Gemma4DSparkModel computes
    them (float64): context = hidden_norm(fc(f)), every layer full attention over [context; block],
    no mask, scale 1, k_norm / scale-free v_norm, sandwich norms, layer_scalar, softcap, Markov bias."""
    eps, H = config["rms_norm_eps"], config["num_attention_heads"]
    D = config["global_head_dim"]
    k_eq_v = config["attention_k_eq_v"]
    KV = config["num_global_key_value_heads"] if k_eq_v else config["num_key_value_heads"]
    rope = config["rope_parameters"]["full_attention"]
    rope_args = dict(theta=rope["rope_theta"], head_dim=D, factor=rope.get("partial_rotary_factor", 1.0), kind=rope["rope_type"])
    p, bs = features.shape[0], config["block_size"]
    ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ids = [anchor] + [config["mask_token_id"]] * (bs - 1)
    h = embed[ids] * np.sqrt(config["hidden_size"])
    pos = np.arange(p + bs, dtype=np.float64)
    for i in range(config["num_hidden_layers"]):
        pre = f"layers.{i}."
        x = _rms(h, w[pre + "input_layernorm.weight"], eps)
        a = pre + "self_attn."
        q = _rms((x @ w[a + "q_proj.weight"].T).reshape(bs, H, D), w[a + "q_norm.weight"], eps)
        rows = np.concatenate([ctx, x])
        k_raw = (rows @ w[a + "k_proj.weight"].T).reshape(-1, KV, D)
        v_raw = k_raw if k_eq_v else (rows @ w[a + "v_proj.weight"].T).reshape(-1, KV, D)
        k = _rope(_rms(k_raw, w[a + "k_norm.weight"], eps), pos, **rope_args)
        v = _rms(v_raw, None, eps)
        q = _rope(q, pos[p:], **rope_args)
        out = np.zeros((bs, H, D))
        for head_i in range(H):
            kv = head_i // (H // KV)
            s = q[:, head_i] @ k[:, kv].T  # scale 1
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, head_i] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        attn = out.reshape(bs, H * D) @ w[a + "o_proj.weight"].T
        h = h + _rms(attn, w[pre + "post_attention_layernorm.weight"], eps)
        m = _rms(h, w[pre + "pre_feedforward_layernorm.weight"], eps)
        m = (_gelu_tanh(m @ w[pre + "mlp.gate_proj.weight"].T) * (m @ w[pre + "mlp.up_proj.weight"].T)) @ w[pre + "mlp.down_proj.weight"].T
        h = (h + _rms(m, w[pre + "post_feedforward_layernorm.weight"], eps)) * w[pre + "layer_scalar"]
    o = _rms(h, w["norm.weight"], eps)
    z = o @ head.T
    cap = config.get("final_logit_softcapping")
    if cap:
        z = np.tanh(z / cap) * cap
    tokens, conf, probs, prev = [], [], [], anchor
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    for k in range(bs):
        e = w1[prev]
        logits = z[k] + w2 @ e
        feat = np.concatenate([o[k], e])
        conf.append(float(1 / (1 + np.exp(-(feat @ w["confidence_head.proj.weight"][0] + w["confidence_head.proj.bias"][0])))))
        prev = int(np.argmax(logits))
        tokens.append(prev)
        probs.append(float(1 / np.exp(logits - logits.max()).sum()))  # max softmax
    return tokens, conf, probs


class _Table:
    """A target that is only the draft's shared embedding table and head (raw rows, plain product)."""

    def __init__(self, embed: np.ndarray, head: np.ndarray):
        self._embed, self._head = mx.array(embed.astype(np.float32)), mx.array(head.astype(np.float32))

    def embed(self, ids):
        return self._embed[ids]

    def lm_head_logits(self, h):
        return h @ self._head.T


@pytest.mark.parametrize(
    "options",
    [{}, {"attention_k_eq_v": False}, {"final_logit_softcapping": None, "partial_rotary_factor": 1.0}, {"final_logit_softcapping": 0.5}],
    ids=["k_eq_v", "own-v_proj", "no-softcap-full-rotary", "tight-softcap"],
)
def test_gemma4_draft_proposes_as_deepspec_modeling_restated_in_numpy(options, tiny_qwen3_target, tmp_path):
    path = write_gemma4_draft(tmp_path / "draft", target_path=tiny_qwen3_target, seed=4, **options)
    config = json.loads((path / "config.json").read_text())
    weights = {k: v.astype(np.float64) for k, v in _read_hf_weights(path).items()}
    pair = mlx_dspark.load(tiny_qwen3_target, draft=path, dtype="float32")
    draft = pair.draft
    assert draft.args.family == "gemma4"
    assert ("v_proj" in draft.layers[0].self_attn) is not config["attention_k_eq_v"]
    table = _Table(weights["embed_tokens.weight"], weights["lm_head.weight"])
    features = np.random.default_rng(1).standard_normal((23, 2 * config["hidden_size"]))
    ctx = draft.make_cache()
    draft.append_context(mx.array(features[None].astype(np.float32)), ctx)
    proposal = draft.propose(mx.array([37]), ctx, target=table)
    tokens, conf, probs = reference_proposal(config, weights, features, 37, embed=weights["embed_tokens.weight"], head=weights["lm_head.weight"])
    assert np.array(proposal.tokens)[0].tolist() == tokens
    np.testing.assert_allclose(np.array(proposal.confidence)[0], conf, rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(proposal.token_probs)[0], probs, rtol=2e-4, atol=1e-6)


def test_gemma4_draft_is_lossless_with_a_target(tiny_qwen3_target, tmp_path):
    # The draft's layer family is its own (DSPARK.md section 6): a Gemma-layer draft over a qwen3 target.
    path = write_gemma4_draft(tmp_path / "draft", target_path=tiny_qwen3_target, seed=2)
    pair = mlx_dspark.load(tiny_qwen3_target, draft=path, dtype="float32")
    for prompt in ("The quick brown fox jumps over the lazy dog. " * 2, "1 2 3 4 5 6 7 8 9 10"):
        plain = mlx_dspark.generate(pair, prompt, max_tokens=40, speculative=False)
        spec = mlx_dspark.generate(pair, prompt, max_tokens=40)
        assert spec.tokens == plain.tokens and spec.acceptance_lengths


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"enable_moe_block": True}, r"config.json: enable_moe_block is true; Gemma 4 DSpark draft layers have no MoE block"),
        ({"hidden_size_per_layer_input": 256}, r"config.json: hidden_size_per_layer_input is 256; .*expected 0"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, r"config.json: layer_types .* every Gemma 4 DSpark draft layer is a full_attention layer"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1.0}}}, r"rope_parameters.full_attention has rope_type 'yarn'"),
    ],
)
def test_gemma4_draft_configs_deepspec_cannot_build_are_refused_by_field(change, message, tiny_qwen3_target, tmp_path):
    path = write_gemma4_draft(tmp_path / "draft", target_path=tiny_qwen3_target)
    config = json.loads((path / "config.json").read_text())
    config.update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        mlx_dspark.load(tiny_qwen3_target, draft=path)


def test_gemma4_draft_missing_its_layer_scalar_names_the_tensor(tiny_qwen3_target, tmp_path):
    path = write_gemma4_draft(tmp_path / "draft", target_path=tiny_qwen3_target)
    weights = {k: v for k, v in mx.load(str(path / "model.safetensors")).items() if k != "layers.1.layer_scalar"}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(ValueError, match=r"layers\.1\.layer_scalar"):
        mlx_dspark.load(tiny_qwen3_target, draft=path)


def test_gemma4_draft_exports_to_deepspec_bitwise_and_gguf_export_refuses_by_name(tiny_qwen3_target, tmp_path):
    from mlx_dspark.export.write import export_draft

    source = write_gemma4_draft(tmp_path / "draft", target_path=tiny_qwen3_target, seed=3)
    out = tmp_path / "deepspec"
    export_draft(source, out, to="deepspec", target=tiny_qwen3_target)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma4DSparkModel"]
    a = mlx_dspark.load(tiny_qwen3_target, draft=source, dtype="float32").draft
    b = mlx_dspark.load(tiny_qwen3_target, draft=out, dtype="float32").draft
    from mlx.utils import tree_flatten

    left, right = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert left.keys() == right.keys() and all(np.array_equal(np.array(left[k]), np.array(right[k])) for k in left)
    assert b.args.layers.final_logit_softcapping == a.args.layers.final_logit_softcapping == 30.0
    with pytest.raises(ValueError, match=r"the draft has Gemma 4 layers .* export it --to deepspec"):
        export_draft(source, tmp_path / "d.gguf", to="gguf", target=tiny_qwen3_target)


@pytest.mark.parametrize("rotary", [0.25, 1.0], ids=["proportional", "full"])
def test_gemma4_draft_as_upstreams_dflash_gguf_proposes_as_its_deepspec_checkpoint(rotary, tiny_qwen3_target, tmp_path):
    from mlx_dspark.testing.draft_layouts import write_gemma4_gguf

    source = write_gemma4_draft(
        tmp_path / "draft", target_path=tiny_qwen3_target, seed=5, attention_k_eq_v=True, final_logit_softcapping=None,
        partial_rotary_factor=rotary,
    )  # fmt: skip
    gguf = write_gemma4_gguf(source, tmp_path / "draft.gguf", target_path=tiny_qwen3_target)
    pair = mlx_dspark.load(tiny_qwen3_target, draft=gguf, dtype="float32")
    reference = mlx_dspark.load(tiny_qwen3_target, draft=source, dtype="float32")
    assert pair.draft.args.family == "gemma4" and pair.draft.args.packaging.embedding_scale is None
    features = mx.array(np.random.default_rng(2).standard_normal((1, 19, 2 * 128)).astype(np.float32))
    out = []
    for model in (pair, reference):
        ctx = model.draft.make_cache()
        model.draft.append_context(features, ctx)
        out.append(model.draft.propose(mx.array([11]), ctx, target=model.target))
    assert out[0].tokens.tolist() == out[1].tokens.tolist()
    np.testing.assert_allclose(np.array(out[0].token_probs), np.array(out[1].token_probs), rtol=1e-5)
    np.testing.assert_allclose(np.array(out[0].confidence), np.array(out[1].confidence), rtol=1e-5)
    plain = mlx_dspark.generate(pair, "1 2 3 4 5 6", max_tokens=30, speculative=False)
    assert mlx_dspark.generate(pair, "1 2 3 4 5 6", max_tokens=30).tokens == plain.tokens


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"dflash.final_logit_softcapping": 30.0}, r"key 'dflash.final_logit_softcapping' is 30; upstream's Gemma 4 DSpark converter refuses"),
        ({"dflash.embedding_scale": 2.0}, r"key 'dflash.embedding_scale' is 2.0; a Gemma 4 draft scales its embeddings by sqrt\(128\)"),
        ({"dflash.attention.scale": 0.125}, r"key 'dflash.attention.scale' is 0.125; a Gemma 4 draft attends with scale 1"),
    ],
)
def test_gemma4_gguf_keys_that_do_not_fit_are_refused_in_one_line(keys, message, tiny_qwen3_target, tmp_path):
    from mlx_dspark.testing.draft_layouts import write_gemma4_gguf

    source = write_gemma4_draft(tmp_path / "draft", target_path=tiny_qwen3_target, attention_k_eq_v=True, final_logit_softcapping=None)
    gguf = write_gemma4_gguf(source, tmp_path / "draft.gguf", target_path=tiny_qwen3_target, extra_keys=keys)
    with pytest.raises(ValueError, match=message) as e:
        mlx_dspark.load(tiny_qwen3_target, draft=gguf)
    assert "draft.gguf" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bits", [None, 8])
def test_gemma4_draft_converts_to_mlx_and_loads_the_same(bits, tiny_qwen3_target, tmp_path):
    from mlx_dspark.loading.convert import convert

    source = write_gemma4_draft(tmp_path / "draft", target_path=tiny_qwen3_target, seed=6)
    out = convert(source, tmp_path / "mlx", quantize=bits is not None, q_bits=bits or 4, log=lambda m: None)
    direct = mlx_dspark.load(tiny_qwen3_target, draft=source, quantize=bits)
    converted = mlx_dspark.load(tiny_qwen3_target, draft=out, quantize=bits)
    assert converted.draft.args.family == "gemma4"
    for pair in (direct, converted):
        plain = mlx_dspark.generate(pair, "1 2 3 4 5 6", max_tokens=25, speculative=False)
        assert mlx_dspark.generate(pair, "1 2 3 4 5 6", max_tokens=25).tokens == plain.tokens
    assert _proposal_tokens(direct) == _proposal_tokens(converted)


def _proposal_tokens(pair) -> list[int]:
    ctx = pair.draft.make_cache()
    pair.draft.append_context(mx.array(np.random.default_rng(3).standard_normal((1, 15, 256)).astype(np.float32)), ctx)
    return pair.draft.propose(mx.array([9]), ctx, target=pair.target).tokens.tolist()


def test_gemma4_training_forward_equals_the_inference_block_forward(tiny_qwen3_target, tmp_path):
    # the embedding scale and the softcap live in the draft (embed_block / cap_logits), so training
    # computes what drafting does; proportional RoPE at every block's own anchor position
    from mlx_dspark.train.data import Batch
    from mlx_dspark.train.forward import Anchors, block_targets, draft_forward, target_pass

    path = write_gemma4_draft(tmp_path / "draft", target_path=tiny_qwen3_target, seed=3, final_logit_softcapping=0.5)
    pair = mlx_dspark.load(tiny_qwen3_target, draft=path, dtype="float32")
    draft, target = pair.draft, pair.target
    tokens = np.random.default_rng(0).integers(10, 300, size=(2, 30)).astype(np.int32)
    anchors = Anchors(np.array([0, 0, 1], np.int32), np.array([0, 9, 21], np.int32))
    logits, features = target_pass(target, mx.array(tokens), tuple(draft.args.target_layer_ids))
    targets = block_targets(Batch(tokens, np.ones(tokens.shape, dtype=bool)), anchors, logits, block_size=draft.args.block_size)
    out = draft_forward(draft, target, features, mx.array(tokens), anchors, targets.prev)
    for i, (b, p) in enumerate(zip(anchors.seq.tolist(), anchors.pos.tolist())):
        context = draft.make_cache()
        draft.append_context(features[b : b + 1, :p], context)
        anchor = mx.array([int(tokens[b, p])])
        np.testing.assert_allclose(np.array(out.hidden[i]), np.array(draft.block_hidden(anchor, context, target=target)[0]), atol=1e-5)
        proposal = draft.propose(anchor, context, target=target, greedy=False, temperature=1.0)
        np.testing.assert_allclose(np.array(mx.softmax(out.logits[i, 0], axis=-1)), np.array(proposal.draft_probs[0, 0]), atol=1e-6)
