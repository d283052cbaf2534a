"""GGUF files (upstream llama.cpp layouts, written by mlx_dspark.testing.gguf_writer from the tiny
checkpoints) read into our checkpoint form: same tensors as the safetensors, equivalent configs,
exact quantized values, and one clear error per bad file."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize

from mlx_dspark.loading.checkpoint import resolve_path
from mlx_dspark.loading.gguf_checkpoint import read_gguf
from mlx_dspark.models import target_model_class
from mlx_dspark.models.target.mlx_lm import from_config as target_from_config, mlx_lm_classes
from mlx_dspark.models.heads.dspark.model import DraftArgs
from mlx_dspark.models.heads.dspark.args import layer_family
from mlx_dspark.testing.gguf_writer import write_gguf_draft, write_gguf_target
from mlx_dspark.testing.tiny import write_tiny_draft, write_tiny_target

# config fields the target / draft models read
TARGET_FIELDS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "layer_types", "sliding_window",
    "tie_word_embeddings", "hidden_act", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip
SPARK_FIELDS = ("rope_parameters", "gate_attn_act_mode", "headwise_attn_output_gate", "mlp_bias")
QWEN3_FIELDS = ("rope_theta", "use_sliding_window")
DRAFT_FIELDS = (
    "block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
    "confidence_head_with_markov",
)  # fmt: skip


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text(encoding="utf-8"))


def _safetensors(path: Path) -> dict[str, mx.array]:
    return mx.load(str(path / "model.safetensors"))


def _bits_equal(a: mx.array, b: mx.array) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == mx.bfloat16:
        a, b = a.view(mx.uint16), b.view(mx.uint16)
    return bool(mx.array_equal(a, b).item())


def _raw(path: Path, name: str):
    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    return t.data, t.tensor_type


def _check_config(found: dict, expected: dict, fields: tuple[str, ...]) -> None:
    for f in fields:
        assert found.get(f) == expected.get(f), f"{f}: {found.get(f)!r} != {expected.get(f)!r}"


# -- targets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
def test_target_gguf_f32_has_the_safetensors_weights_bitwise_and_the_config(family, request, tmp_path):
    source = request.getfixturevalue(f"tiny_{'spark' if family == 'spark2_5' else 'qwen3'}_target")
    ck = read_gguf(write_gguf_target(source, tmp_path / "t.gguf"), role="target")
    expected = _safetensors(source)
    assert sorted(ck.weights) == sorted(expected)
    assert all(_bits_equal(ck.weights[k], v) for k, v in expected.items())
    fields = TARGET_FIELDS + (SPARK_FIELDS if family == "spark2_5" else QWEN3_FIELDS)
    _check_config(ck.config, _config(source), fields)
    target_from_config(ck.config, source=str(ck.path))  # mlx-lm's class takes the config as it is
    assert mlx_lm_classes(ck.config)[0].__module__ == f"mlx_lm.models.{family}"
    assert "quantization" not in ck.config and ck.role == "target" and ck.origin["model.norm.weight"] == ck.path


def test_target_gguf_bf16_is_read_exactly_not_through_float16(tmp_path):
    source = write_tiny_target(tmp_path / "bf16", family="spark2_5", dtype="bfloat16")
    # a value float16 cannot hold: BF16 read through float16 would turn it into inf
    ck = read_gguf(write_gguf_target(source, tmp_path / "t.gguf", tensor_type="BF16"))
    expected = _safetensors(source)
    for k, v in expected.items():  # upstream keeps 1-D tensors (norms) in F32
        assert _bits_equal(ck.weights[k], v if v.ndim == 2 else v.astype(mx.float32)), k
    assert ck.tensor_types["model.layers.0.mlp.up_proj.weight"] == "BF16"
    big = mx.array([3.0e38], dtype=mx.float32).astype(mx.bfloat16)
    path = tmp_path / "big.gguf"
    w = GGUFWriter(path, "qwen3")
    from gguf import GGMLQuantizationType

    w.add_tensor("x", np.array(big.view(mx.uint16)).view(np.uint8).reshape(1, 2), raw_dtype=GGMLQuantizationType.BF16)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    from mlx_dspark.loading.gguf_metadata import Metadata
    from mlx_dspark.loading.gguf_tensors import read_tensor as _read_tensor

    meta = Metadata.open(path)
    assert _bits_equal(_read_tensor(meta, meta.tensors["x"], kquant="float32").weight, big.reshape(1, 1))


def test_spark_target_gguf_with_separate_qkv_is_fused(tiny_spark_target, tmp_path):
    ck = read_gguf(write_gguf_target(tiny_spark_target, tmp_path / "t.gguf", separate_qkv=True, tensor_type="F16"))
    expected = _safetensors(tiny_spark_target)
    assert sorted(ck.weights) == sorted(expected)
    for k, v in expected.items():
        assert _bits_equal(ck.weights[k], v.astype(mx.float16) if v.ndim == 2 else v), k


@pytest.mark.parametrize("kind,bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4)])
def test_q8_0_q4_0_q4_1_stay_quantized_with_exactly_ggufs_values(tiny_qwen3_target, tmp_path, kind, bits):
    path = write_gguf_target(tiny_qwen3_target, tmp_path / "t.gguf", tensor_type=kind, tensor_types={"blk.1.ffn_up.weight": "Q8_0"})
    ck = read_gguf(path)
    name = "model.layers.0.mlp.up_proj"
    w, s, b = (ck.weights[f"{name}.{x}"] for x in ("weight", "scales", "biases"))
    assert w.dtype == mx.uint32 and s.dtype == mx.float16
    values = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits)
    data, qtype = _raw(path, "blk.0.ffn_up.weight")
    assert np.array_equal(np.array(values), dequantize(data, qtype))
    assert ck.config["quantization"]["group_size"] == 32 and ck.config["quantization"]["bits"] == bits
    if bits == 4:
        assert ck.config["quantization"]["model.layers.1.mlp.up_proj"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert ck.weights["model.norm.weight"].dtype == mx.float32  # 1-D tensors stay float
    # the stored quantization loads into a model as mlx-lm's would
    from mlx_dspark.loading.weights import apply_stored_quantization

    model = target_from_config(ck.config, model_class=target_model_class(ck.config))
    apply_stored_quantization(model, ck.config, ck.weights, source=ck.path)
    model.load_weights(list(ck.weights.items()), strict=True)


KQUANTS = {"blk.0.ffn_down.weight": "Q4_K", "blk.0.attn_output.weight": "Q6_K", "blk.1.ffn_down.weight": "Q5_K",
           "blk.1.attn_output.weight": "Q3_K", "blk.2.ffn_down.weight": "Q2_K"}  # fmt: skip
OURS = {"blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj", "blk.0.attn_output.weight": "model.layers.0.self_attn.out_proj",
        "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj", "blk.1.attn_output.weight": "model.layers.1.self_attn.out_proj",
        "blk.2.ffn_down.weight": "model.layers.2.mlp.down_proj"}  # fmt: skip


@pytest.fixture(scope="module")
def kquant_gguf(tiny_spark_target, tmp_path_factory) -> Path:
    # K-quant rows need multiples of 256 columns: the tiny spark's down / out projections have 256
    return write_gguf_target(tiny_spark_target, tmp_path_factory.mktemp("kq") / "t.gguf", tensor_types=KQUANTS)


def test_kquants_dequantize_exactly_as_gguf(kquant_gguf):
    ck = read_gguf(kquant_gguf, kquant="float32")
    for gname, ours in OURS.items():
        data, qtype = _raw(kquant_gguf, gname)
        assert ck.tensor_types[f"{ours}.weight"] == KQUANTS[gname]
        assert np.array_equal(np.array(ck.weights[f"{ours}.weight"]), dequantize(data, qtype)), gname
    bf16 = read_gguf(kquant_gguf, kquant="bfloat16")
    for ours in OURS.values():
        assert _bits_equal(bf16.weights[f"{ours}.weight"], ck.weights[f"{ours}.weight"].astype(mx.bfloat16))


def test_kquants_become_mlx_quantization_q4_k_q5_k_on_their_own_grid(kquant_gguf):
    ck = read_gguf(kquant_gguf)  # default: requantize
    quant = ck.config["quantization"]
    for gname, ours in OURS.items():
        bits = 8 if KQUANTS[gname] in ("Q6_K", "Q5_K") else 4
        setting = quant.get(ours, quant)
        assert setting["bits"] == bits and setting["group_size"] == 32, gname
        w, s, b = (ck.weights[f"{ours}.{x}"] for x in ("weight", "scales", "biases"))
        values = np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits))
        data, qtype = _raw(kquant_gguf, gname)
        reference = dequantize(data, qtype)
        if KQUANTS[gname] in ("Q4_K", "Q5_K"):
            # the same grid: only the float16 rounding of scale and bias (2^-11 relative) differs
            bias = np.repeat(np.abs(np.array(b.astype(mx.float32))), 32, axis=-1)
            assert np.all(np.abs(values - reference) <= 1e-3 * (np.abs(reference) + bias) + 1e-7), gname
        else:  # re-quantized onto MLX's grid: within one MLX step
            step = np.repeat(np.abs(np.array(s.astype(mx.float32))), 32, axis=-1)
            assert np.all(np.abs(values - reference) <= step + 1e-3 * np.abs(reference) + 1e-7), gname


# -- drafts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
@pytest.mark.parametrize("arch", ["dflash", "dspark"])
@pytest.mark.parametrize("include_shared", [True, False])
def test_draft_gguf_has_the_deepspec_weights_bitwise_and_config(family, arch, include_shared, request, tmp_path):
    target, draft = request.getfixturevalue(f"tiny_{'spark' if family == 'spark2_5' else 'qwen3'}_pair")
    path = write_gguf_draft(draft, tmp_path / "d.gguf", target_path=target, arch=arch, include_shared=include_shared,
                            mask_key="arch" if arch == "dspark" else "tokenizer")  # fmt: skip
    ck = read_gguf(path, role="draft")
    expected = {("embed_tokens.weight" if k == "embedding.weight" else k): v for k, v in _safetensors(draft).items()}
    if not include_shared:
        expected = {k: v for k, v in expected.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    assert sorted(ck.weights) == sorted(expected)
    assert all(_bits_equal(ck.weights[k], v) for k, v in expected.items())
    config = _config(draft)
    fields = TARGET_FIELDS[:10] + ("layer_types", "sliding_window", "hidden_act") + DRAFT_FIELDS
    _check_config(ck.config, config, fields + (SPARK_FIELDS[:2] if family == "spark2_5" else QWEN3_FIELDS))
    args = DraftArgs.from_dict(ck.config, family=layer_family(list(ck.weights), source=str(path)), source=str(path))
    assert args.family == family and list(args.target_layer_ids) == config["target_layer_ids"]
    assert ck.tokenizer is not None and ck.config["mask_token_id"] == config["mask_token_id"]
    assert ("mask" in ck.tokenizer.special_ids) == (arch == "dflash")  # dspark files: <arch>.mask_token_id


def test_draft_family_comes_from_the_draft_tensors_not_the_target(tiny_spark_target, tmp_path):
    draft = write_tiny_draft(tmp_path / "q3draft", target_path=tiny_spark_target, layer_family="qwen3")
    ck = read_gguf(write_gguf_draft(draft, tmp_path / "d.gguf", target_path=tiny_spark_target))
    assert ck.config["architectures"] == ["Qwen3DSparkModel"] and ck.config["model_type"] == "qwen3"
    assert "layers.0.self_attn.q_proj.weight" in ck.weights
    assert all(_bits_equal(ck.weights[k], v) for k, v in _safetensors(draft).items() if not k.startswith(("embed", "lm_head")))


def test_draft_tap_conventions_and_the_override(tiny_qwen3_pair, tmp_path):
    target, draft = tiny_qwen3_pair
    taps = _config(draft)["target_layer_ids"]  # [0, 2]
    plus_one = write_gguf_draft(draft, tmp_path / "p.gguf", target_path=target)
    older = write_gguf_draft(draft, tmp_path / "h.gguf", target_path=target, tap_convention="hf")
    assert read_gguf(plus_one).config["target_layer_ids"] == taps
    assert read_gguf(older).config["target_layer_ids"] == [i - 1 for i in taps]  # read as +1: off by one
    assert read_gguf(older, tap_ids=taps).config["target_layer_ids"] == taps
    with pytest.raises(ValueError, match=r"tap_ids \[1\] must be 2 layer ids"):
        read_gguf(older, tap_ids=[1])


def test_draft_without_confidence_head_and_with_conf_head_without_markov(tiny_qwen3_target, tmp_path):
    draft = write_tiny_draft(tmp_path / "d1", target_path=tiny_qwen3_target, confidence_head_with_markov=False)
    ck = read_gguf(write_gguf_draft(draft, tmp_path / "d1.gguf", target_path=tiny_qwen3_target))
    assert ck.config["enable_confidence_head"] and not ck.config["confidence_head_with_markov"]
    draft = write_tiny_draft(tmp_path / "d2", target_path=tiny_qwen3_target, enable_confidence_head=False,
                             layer_types=["full_attention", "sliding_attention", "full_attention"])  # fmt: skip
    ck = read_gguf(write_gguf_draft(draft, tmp_path / "d2.gguf", target_path=tiny_qwen3_target))
    assert not ck.config["enable_confidence_head"] and "confidence_head.proj.weight" not in ck.weights
    assert ck.config["layer_types"] == ["full_attention", "sliding_attention", "full_attention"]


# -- bad files -------------------------------------------------------------------------------------


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_truncated_gguf_is_one_clear_error(tiny_qwen3_pair, tmp_path):
    target, draft = tiny_qwen3_pair
    path = write_gguf_draft(draft, tmp_path / "d.gguf", target_path=target)
    data = path.read_bytes()
    for cut in (len(data) // 2, 200, len(data) - 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated") as e:
            read_gguf(bad)
        assert str(bad) in _one_line(e)


def test_unknown_architecture_names_it_and_the_supported_ones(tmp_path):
    path = tmp_path / "llama.gguf"
    w = GGUFWriter(path, "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=r"architecture 'llama' is not supported.*dflash, dspark.*spark2_5, qwen3") as e:
        read_gguf(path)
    _one_line(e)


def test_missing_unexpected_and_reduced_vocabulary_tensors_are_named(tiny_spark_pair, tmp_path):
    target, draft = tiny_spark_pair
    path = write_gguf_draft(draft, tmp_path / "m.gguf", target_path=target, drop_tensors=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['blk.1.ffn_up.weight'\]") as e:
        read_gguf(path)
    _one_line(e)
    extra = {"blk.0.attn_q_norm.weight": np.ones(64, np.float32)}
    path = write_gguf_draft(draft, tmp_path / "u.gguf", target_path=target, extra_tensors=extra)
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) \['blk.0.attn_q_norm.weight'\]"):
        read_gguf(path)
    path = write_gguf_draft(draft, tmp_path / "r.gguf", target_path=target, extra_tensors={"d2t": np.zeros(8, np.int64)})
    # a d2t table whose size does not fit markov_w2 (full-vocabulary rows here) is named
    with pytest.raises(ValueError, match=r"tensor 'markov_w2.weight' has shape \(384, 16\); expected 8 rows, one per entry of 'd2t'") as e:
        read_gguf(path)
    _one_line(e)


def test_role_mismatch_and_bad_options(tiny_qwen3_pair, tiny_spark_target, tmp_path):
    target, draft = tiny_qwen3_pair
    path = write_gguf_target(target, tmp_path / "t.gguf")
    # a qwen3 language model given as the draft is a draft model (tests/test_gguf_draft_lm.py), a spark2_5 one a target
    assert read_gguf(path, role="draft").config["architectures"] == ["Qwen3ForCausalLM"]
    spark = write_gguf_target(tiny_spark_target, tmp_path / "s.gguf")
    with pytest.raises(ValueError, match="is a target .*given as the draft"):
        read_gguf(spark, role="draft")
    with pytest.raises(ValueError, match="is a draft .*given as the target"):
        read_gguf(write_gguf_draft(draft, tmp_path / "d.gguf", target_path=target), role="target")
    with pytest.raises(ValueError, match="kquant 'int4' is not one of"):
        read_gguf(path, kquant="int4")


# -- paths -----------------------------------------------------------------------------------------


def test_resolve_path_accepts_gguf_files_and_single_gguf_directories(tiny_qwen3_pair, tmp_path):
    target, draft = tiny_qwen3_pair
    (tmp_path / "one").mkdir()
    path = write_gguf_draft(draft, tmp_path / "one" / "Draft.gguf", target_path=target)
    assert resolve_path(path, role="draft") == path
    assert resolve_path(tmp_path / "one", role="draft") == path
    assert resolve_path(target) == target  # a checkpoint directory stays one
    write_gguf_draft(draft, tmp_path / "one" / "Other.gguf", target_path=target)
    with pytest.raises(FileNotFoundError, match="several GGUF files.*Draft.gguf.*Other.gguf"):
        resolve_path(tmp_path / "one", role="draft")


def test_resolve_path_downloads_one_file_of_a_hub_repo(monkeypatch, tmp_path):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, filename):
        calls.append((repo_id, filename))
        return str(tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    assert resolve_path("XHToken/Spark-X2.6-4B-DSpark-GGUF:Spark-draft.gguf", role="draft") == tmp_path / "Spark-draft.gguf"
    assert calls == [("XHToken/Spark-X2.6-4B-DSpark-GGUF", "Spark-draft.gguf")]


def test_resolve_path_hub_file_offline_is_one_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match=r"draft owner/repo:sub/model-Q4_K_M.gguf: the file .*could not be downloaded") as e:
        resolve_path("owner/repo:sub/model-Q4_K_M.gguf", role="draft")
    assert "HF_HUB_OFFLINE" in _one_line(e)
