"""Exporting drafts (python -m mlx_dspark.export): llama.cpp's dflash GGUF and DeepSpec's Hugging Face
layout, from every kind of draft we load; our loader must draft bitwise like the source from both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_dspark
from mlx_dspark.loading.convert import convert
from mlx_dspark.export.write import export_draft
from mlx_dspark.testing.gguf_writer import write_gguf_draft
from mlx_dspark.testing.tiny import write_tiny_draft

# longer than the tiny drafts' window (16), so the sliding context is exercised
TEXT = "Speculative decoding drafts tokens; the target verifies them. def f(x): return x ** 2  # 42 " * 2


def _proposal(pair) -> list[np.ndarray]:
    target, draft = pair.target, pair.draft
    tokens = mx.array([pair.tokenizer.encode(TEXT)], dtype=mx.int32)
    _, features = target(tokens, tap_ids=tuple(draft.args.target_layer_ids))
    ctx = draft.make_cache()
    draft.append_context(features[:, :-1], ctx)
    proposal = draft.propose(tokens[:, -1], ctx, target=target)
    return [_np(proposal.tokens), _np(proposal.token_probs), _np(proposal.confidence)]


def _np(x: mx.array) -> np.ndarray:
    """Exact numpy values (bfloat16 as its bits: numpy has no bfloat16)."""
    return np.array(x.view(mx.uint16)) if x.dtype == mx.bfloat16 else np.array(x)


def _params(model) -> dict[str, np.ndarray]:
    return {k: _np(v) for k, v in tree_flatten(model.parameters())}


def _assert_same_draft(target: Path, source: Path, exported: Path, **load) -> None:
    a = mlx_dspark.load(str(target), draft=str(source), **load)
    b = mlx_dspark.load(str(target), draft=str(exported), **load)
    pa, pb = _params(a.draft), _params(b.draft)
    assert sorted(pa) == sorted(pb)
    for name in pa:
        assert pa[name].dtype == pb[name].dtype and np.array_equal(pa[name], pb[name]), name
    for x, y in zip(_proposal(a), _proposal(b)):
        assert np.array_equal(x, y)
    for field in ("family", "block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
                  "enable_confidence_head", "confidence_head_with_markov", "layer_types"):  # fmt: skip
        assert getattr(a.draft.args, field) == getattr(b.draft.args, field), field
    assert [a.draft.args.layer_window(i) for i in range(a.draft.args.num_hidden_layers)] == [
        b.draft.args.layer_window(i) for i in range(b.draft.args.num_hidden_layers)
    ]


def _out(tmp_path: Path, to: str) -> Path:
    return tmp_path / ("draft.gguf" if to == "gguf" else "deepspec")


@pytest.mark.parametrize("to", ["gguf", "deepspec"])
@pytest.mark.parametrize(
    ("target_family", "layer_family"), [("qwen3", "qwen3"), ("spark2_5", "spark2_5"), ("spark2_5", "qwen3")]
)
def test_export_round_trips_bitwise(to, target_family, layer_family, tiny_qwen3_target, tiny_spark_target, tmp_path):
    target = tiny_qwen3_target if target_family == "qwen3" else tiny_spark_target
    source = write_tiny_draft(tmp_path / "source", target_path=target, layer_family=layer_family, seed=4)
    out = _out(tmp_path, to)
    export_draft(source, out, to=to, target=target)
    _assert_same_draft(target, source, out)


@pytest.mark.parametrize("to", ["gguf", "deepspec"])
def test_export_from_a_gguf_draft_round_trips_bitwise(to, tiny_spark_pair, tmp_path):
    target, draft = tiny_spark_pair
    source = write_gguf_draft(draft, tmp_path / "source.gguf", target_path=target, include_shared=False)
    out = _out(tmp_path, to)
    export_draft(source, out, to=to, target=target)  # the GGUF's tokenizer keys or the target's
    _assert_same_draft(target, source, out)
    if to == "gguf":  # without --target, the source GGUF's own tokenizer keys are copied
        export_draft(source, tmp_path / "again.gguf", to=to)
        _assert_same_draft(target, source, tmp_path / "again.gguf")


def test_gguf_export_has_upstreams_keys_and_tensors(tiny_qwen3_pair, tmp_path):
    """An independent copy of upstream's layout (the test writer, from GGUF.md) has the same tensors
    (names, shapes, types) and the same values of every dflash key it writes."""
    from gguf import GGUFReader

    target, draft = tiny_qwen3_pair
    ours = tmp_path / "ours.gguf"
    export_draft(draft, ours, to="gguf", target=target)
    reference = write_gguf_draft(draft, tmp_path / "reference.gguf", target_path=target, include_shared=False)
    a, b = GGUFReader(ours), GGUFReader(reference)
    tensors = lambda r: {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name) for t in r.tensors}  # noqa: E731
    assert tensors(a) == tensors(b)
    for key, field in b.fields.items():
        if key.startswith("dflash.") or key in ("tokenizer.ggml.mask_token_id", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            assert key in a.fields, key
            assert a.fields[key].contents() == field.contents(), key
    assert a.fields["dflash.target_layers"].contents() == [i + 1 for i in json.loads((draft / "config.json").read_text())["target_layer_ids"]]


def test_bf16_gguf_export_equals_the_source_in_bfloat16(tiny_qwen3_pair, tmp_path):
    from gguf import GGUFReader

    target, draft = tiny_qwen3_pair
    out = tmp_path / "draft-bf16.gguf"
    export_draft(draft, out, to="gguf", target=target, bf16=True)
    kinds = {t.tensor_type.name for t in GGUFReader(out).tensors if len(t.shape) == 2}
    assert kinds == {"BF16"}
    _assert_same_draft(target, draft, out, dtype="bfloat16")


def test_deepspec_export_has_the_published_layout(shared_fixtures, tmp_path):
    source = shared_fixtures / "deepspec-tiny" / "draft"
    target = shared_fixtures / "deepspec-tiny" / "target"
    out = tmp_path / "deepspec"
    export_draft(source, out, to="deepspec")  # the fixture carries its embedding / head copies: no target needed
    names = lambda d: sorted(mx.load(str(d / "model.safetensors")))  # noqa: E731
    assert names(out) == names(source)
    ours, theirs = (json.loads((d / "config.json").read_text()) for d in (out, source))
    for key in ("architectures", "block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
                "enable_confidence_head", "confidence_head_with_markov", "layer_types", "sliding_window",
                "num_target_layers", "hidden_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings"):  # fmt: skip
        assert ours[key] == theirs[key], key
    _assert_same_draft(target, source, out)


def test_gated_markov_draft_exports_to_deepspec_but_gguf_refuses_it_by_name(shared_fixtures, tmp_path):
    source = shared_fixtures / "deepspec-tiny" / "draft-gated"
    target = shared_fixtures / "deepspec-tiny" / "target"
    with pytest.raises(ValueError, match="Markov head is gated.*only the vanilla"):
        export_draft(source, tmp_path / "d.gguf", to="gguf", target=target)
    assert not (tmp_path / "d.gguf").exists()
    export_draft(source, tmp_path / "deepspec", to="deepspec")
    _assert_same_draft(target, source, tmp_path / "deepspec")


def test_quantized_mlx_draft_is_exported_dequantized_with_a_note(tiny_qwen3_pair, tmp_path):
    target, draft = tiny_qwen3_pair
    quantized = convert(draft, tmp_path / "q4", quantize=True, q_bits=4, q_group_size=64, log=lambda _: None)
    notes = export_draft(quantized, tmp_path / "deepspec", to="deepspec", target=target)
    assert any("dequantized" in n for n in notes)
    q = mlx_dspark.load(str(target), draft=str(quantized)).draft
    exported = mlx_dspark.load(str(target), draft=str(tmp_path / "deepspec")).draft
    layer = q.layers[0].self_attn.q_proj
    expected = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=layer.group_size, bits=layer.bits)
    assert np.array_equal(np.array(exported.layers[0].self_attn.q_proj.weight), np.array(expected))
    # and the dequantized export drafts as the quantized source (the same values, another matmul kernel)
    a = mlx_dspark.load(str(target), draft=str(quantized))
    b = mlx_dspark.load(str(target), draft=str(tmp_path / "deepspec"))
    pa, pb = _proposal(a), _proposal(b)
    assert np.array_equal(pa[0], pb[0])
    np.testing.assert_allclose(pb[1], pa[1], rtol=1e-4, atol=1e-5)


def test_deepspec_export_without_the_embedding_copies_asks_for_the_target(tiny_qwen3_pair, tmp_path):
    target, draft = tiny_qwen3_pair
    ours = convert(draft, tmp_path / "mlx", log=lambda _: None)  # our layout drops the shared copies
    with pytest.raises(ValueError, match="pass --target"):
        export_draft(ours, tmp_path / "deepspec", to="deepspec")
    export_draft(ours, tmp_path / "deepspec", to="deepspec", target=target)
    weights = mx.load(str(tmp_path / "deepspec" / "model.safetensors"))
    target_weights = mx.load(str(target / "model.safetensors"))
    assert np.array_equal(np.array(weights["embed_tokens.weight"]), np.array(target_weights["model.embed_tokens.weight"]))
    assert np.array_equal(np.array(weights["lm_head.weight"]), np.array(target_weights["lm_head.weight"]))


def test_export_command_refuses_to_overwrite_without_force(tiny_qwen3_pair, tmp_path):
    target, draft = tiny_qwen3_pair
    for to, out in (("gguf", tmp_path / "d.gguf"), ("deepspec", tmp_path / "ds")):
        command = [sys.executable, "-m", "mlx_dspark.export", "--to", to, str(draft), str(out), "--target", str(target)]
        first = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stderr
        before = sorted(p.stat().st_mtime_ns for p in ([out] if to == "gguf" else out.iterdir()))
        second = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "--force" in second.stderr
        assert sorted(p.stat().st_mtime_ns for p in ([out] if to == "gguf" else out.iterdir())) == before
        third = subprocess.run([*command, "--force"], capture_output=True, text=True, timeout=120)
        assert third.returncode == 0, third.stderr
    _assert_same_draft(target, draft, tmp_path / "d.gguf")


def test_gguf_export_takes_the_tokenizer_of_a_target_gguf(tiny_spark_pair, tmp_path):
    from gguf import GGUFReader

    from mlx_dspark.testing.gguf_writer import write_gguf_target

    target, draft = tiny_spark_pair
    target_gguf = write_gguf_target(target, tmp_path / "target.gguf")
    out = tmp_path / "draft.gguf"
    export_draft(draft, out, to="gguf", target=target_gguf)
    ours, theirs = GGUFReader(out).fields, GGUFReader(target_gguf).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id"):
        assert ours[key].contents() == theirs[key].contents(), key
    assert ours["tokenizer.ggml.mask_token_id"].contents() == json.loads((draft / "config.json").read_text())["mask_token_id"]
    _assert_same_draft(target, draft, out)
