"""A plain causal LM's GGUF given as the draft (llama.cpp's `-md small.gguf`, issue 51): read as the draft model
it is (the `lm` head, mlx-lm's class of its family), never as a DSpark draft.

Each file is written as llama.cpp's converter writes it (testing/gguf_writer.py: `llama` with its q / k rows
permuted for interleaved RoPE, `qwen2` with q / k / v biases and a tied head, `qwen3` with q / k norms) from a
tiny Hugging Face model of the target's tokenizer; loaded from the GGUF it is the same draft as loaded from the
safetensors (its logits, its proposals round by round), its greedy speculation is plain decoding, and what we
cannot run (RoPE scaling, experts, another vocabulary) is one line naming the file and the fix (another family:
tests/test_gguf_load.py's bad drafts).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.loading.checkpoint import read_checkpoint
from mlx_dspark.loading.heads import detect_head
from mlx_dspark.testing.gguf_writer import llama_permute, write_gguf_target
from mlx_dspark.testing.mlx_lm_checkpoints import write_tiny_mlx_lm_target
from mlx_dspark.testing.tiny import write_tiny_target
from tests.test_draft_lm import perturbed_copy

PROMPT = [5, 17, 33, 9, 100, 3, 44, 250, 12]
FAMILIES = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The llama target; per family a Hugging Face draft model and its GGUF (the llama draft a perturbed copy of
    the target, so that its drafts are accepted in part)."""
    root = tmp_path_factory.mktemp("gguf_draft_lm")
    target = write_tiny_mlx_lm_target(root / "target", family="llama", seed=0)
    hf = {
        "llama": perturbed_copy(target, root / "llama"),
        "qwen2": write_tiny_mlx_lm_target(root / "qwen2", family="qwen2", seed=1),
        "qwen3": write_tiny_target(root / "qwen3", family="qwen3", seed=1),
    }
    return target, {family: (path, write_gguf_target(path, root / f"{family}.gguf")) for family, path in hf.items()}


def draft_logits(loaded, ids):
    draft = loaded.heads["lm"]
    return draft(mx.array([ids]), draft.make_cache())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_plain_lm_gguf_given_as_the_draft_is_a_draft_model(files, family):
    _, drafts = files
    _, gguf = drafts[family]
    checkpoint = read_checkpoint(gguf, role="draft")
    assert detect_head(checkpoint.config) == "lm" and checkpoint.config["model_type"] == family


@pytest.mark.parametrize("family", FAMILIES)
def test_a_plain_lm_gguf_draft_is_the_same_draft_as_its_safetensors(files, family):
    target, drafts = files
    hf, gguf = drafts[family]
    from_hf = mlx_dspark.load(str(target), draft=str(hf))
    from_gguf = mlx_dspark.load(str(target), draft=str(gguf))
    assert list(from_gguf.heads) == ["lm"]
    ids = PROMPT + list(range(60, 80))
    assert mx.allclose(draft_logits(from_gguf, ids), draft_logits(from_hf, ids), atol=1e-5, rtol=1e-5).item()
    plain = mlx_dspark.generate(from_hf, PROMPT, max_tokens=40, speculative=False).tokens
    runs = [mlx_dspark.generate(m, PROMPT, max_tokens=40, max_draft_tokens=3, lookup="off") for m in (from_hf, from_gguf)]
    assert runs[0].tokens == runs[1].tokens == plain
    assert runs[0].acceptance_lengths == runs[1].acceptance_lengths  # the same proposals, round by round
    if family == "llama":
        assert 0 < sum(runs[1].acceptance_lengths) - runs[1].rounds < 3 * runs[1].rounds  # accepted in part


def test_llamas_q_and_k_rows_are_put_back_from_llama_cpps_interleaved_order(files):
    """The fixture's file holds q / k permuted (as upstream's converter writes them); the draft read from it holds
    the Hugging Face rows, every head's, for the query heads and the fewer key heads alike."""
    target, drafts = files
    hf, gguf = drafts["llama"]
    from gguf import GGUFReader

    stored = {t.name: np.asarray(t.data) for t in GGUFReader(gguf).tensors}
    weights = mx.load(str(next(hf.glob("*.safetensors"))))
    model = mlx_dspark.load(str(target), draft=str(gguf)).heads["lm"].model
    for proj, name in (("q_proj", "blk.1.attn_q.weight"), ("k_proj", "blk.1.attn_k.weight")):
        original = np.array(weights[f"model.layers.1.self_attn.{proj}.weight"])
        assert not np.array_equal(stored[name], original)
        assert np.array_equal(np.array(getattr(model.layers[1].self_attn, proj).weight), original)


def test_the_fixtures_llama_permute_turns_rotate_half_rope_into_llama_cpps_interleaved_rope():
    """Why upstream permutes (and the fixture restates it right): interleaved RoPE over the permuted rows' queries
    is rotate-half RoPE over the Hugging Face rows' queries, each head's dims reordered as its rows were."""
    heads, head_dim, hidden = 4, 16, 32
    rng = np.random.default_rng(0)
    weight, x = rng.standard_normal((heads * head_dim, hidden)), rng.standard_normal((1, 5, hidden))

    def roped(w, traditional):
        q = mx.array((x @ w.T).reshape(1, 5, heads, head_dim).transpose(0, 2, 1, 3), dtype=mx.float32)  # (B, H, L, D)
        return np.array(mx.fast.rope(q, head_dim, traditional=traditional, base=10000.0, scale=1.0, offset=3))

    order = llama_permute(np.arange(heads * head_dim), heads)[:head_dim]  # one head's rows, as permuted
    assert np.allclose(roped(llama_permute(weight, heads), True), roped(weight, False)[..., order], atol=1e-5)


def test_a_quantized_llama_gguf_draft_keeps_its_rows_in_order(files):
    """Q8_0: the un-permute moves whole rows of the quantized weight, scales and biases; the draft's logits stay
    within the quantization's error of the float draft's (a wrong row order would not)."""
    target, drafts = files
    hf, _ = drafts["llama"]
    q8 = write_gguf_target(hf, hf.parent / "llama-q8_0.gguf", tensor_type="Q8_0")
    quantized = mlx_dspark.load(str(target), draft=str(q8), dtype="float32")
    assert "quantization" in read_checkpoint(q8, role="draft").config
    ids = PROMPT + list(range(60, 80))
    want = draft_logits(mlx_dspark.load(str(target), draft=str(hf)), ids)
    error = mx.abs(draft_logits(quantized, ids) - want).max().item()
    assert error < 0.05 * mx.abs(want).max().item(), error
    plain = mlx_dspark.generate(quantized, PROMPT, max_tokens=24, speculative=False).tokens
    assert mlx_dspark.generate(quantized, PROMPT, max_tokens=24, max_draft_tokens=3).tokens == plain


@pytest.mark.parametrize(
    "keys, tensors, says",
    [
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}, {}, "llama.rope.scaling.type' is 'linear'"),
        ({}, {"rope_freqs.weight": np.ones(16, np.float32)}, "tensor 'rope_freqs.weight' (Llama 3's RoPE scaling)"),
        ({"llama.expert_count": 4}, {}, "llama.expert_count' is 4"),
    ],
    ids=["rope_scaling", "rope_freqs", "experts"],
)
def test_a_llama_gguf_draft_we_cannot_run_is_refused_in_one_line_with_the_fix(files, tmp_path, keys, tensors, says):
    target, drafts = files
    hf, _ = drafts["llama"]
    gguf = write_gguf_target(hf, tmp_path / "other.gguf", extra_keys=keys, extra_tensors=tensors)
    with pytest.raises(ValueError) as err:
        mlx_dspark.load(str(target), draft=str(gguf))
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{gguf}: ") and says in line, line
    assert "mlx_lm.convert" in line and "--draft" in line, line


def test_a_gguf_draft_model_whose_tokenizer_differs_is_refused_naming_both_files(files, tmp_path):
    target, drafts = files
    hf, _ = drafts["qwen2"]
    other = shutil.copytree(hf, tmp_path / "other")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    gguf = write_gguf_target(other, tmp_path / "other.gguf")
    with pytest.raises(ValueError) as err:
        mlx_dspark.load(str(target), draft=str(gguf))
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{gguf}: the draft model's tokenizer differs from the target's") and str(target) in line
