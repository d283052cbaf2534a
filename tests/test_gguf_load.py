"""GGUF files through `load()`, the command lines and the converter: drafts propose exactly as their
safetensors, targets compute as their Hugging Face load (or as llama.cpp's dequantized values), the
tokenizer comes from beside the file or from its metadata, and every bad file is one clear line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize
from mlx.utils import tree_flatten
from typer.testing import CliRunner

import mlx_dspark
from mlx_dspark.loading.checkpoint import Checkpoint
from mlx_dspark.loading.convert import convert
from mlx_dspark.loading.load import build_target
from mlx_dspark.testing.gguf_writer import gguf_name, write_gguf_draft, write_gguf_target
from mlx_dspark.testing.tiny import _read_hf_weights, write_tiny_draft, write_tiny_target

PROMPT = [5, 17, 42, 99, 7, 250, 3, 64, 12, 80]
TEXT_PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 2, "1 2 3 4 5 6 7 8 9 10"]
MIXED_TEXT = (
    "Speculative decoding drafts tokens; the target verifies them.\n\tdef f(x):\n        return x ** 2  # 42\n"
    "Ünïcödé, 日本語, emoji 🚀, numbers 3.14159 and 1,000,000; <think>reasoning</think> then <|mask|> "
)


@pytest.fixture(autouse=True)
def _tokenizer_cache(tmp_path, monkeypatch):
    # GGUF tokenizers are written under $XDG_CACHE_HOME/mlx_dspark/gguf-tokenizers: keep them in the test's tmp
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text(encoding="utf-8"))


def _logits(pair) -> np.ndarray:
    logits, _ = pair.target(mx.array([PROMPT]))
    return np.array(logits.astype(mx.float32))


def _proposal(pair, prompt_ids: list[int] = PROMPT) -> list[np.ndarray]:
    """The draft's first proposal after a prefill of `prompt_ids` (tokens, token_probs, confidence)."""
    target, draft = pair.target, pair.draft
    tokens = mx.array([prompt_ids], dtype=mx.int32)
    _, features = target(tokens, tap_ids=tuple(draft.args.target_layer_ids))
    ctx = draft.make_cache()
    draft.append_context(features[:, :-1], ctx)
    proposal = draft.propose(tokens[:, -1], ctx, target=target)
    return [np.array(proposal.tokens), np.array(proposal.token_probs), np.array(proposal.confidence)]


def _same_proposals(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(_proposal(a), _proposal(b)))


def _params(model) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in tree_flatten(model.parameters())}


def _lossless(pair) -> None:
    for prompt in TEXT_PROMPTS:
        plain = mlx_dspark.generate(pair, prompt, max_tokens=24, speculative=False)
        spec = mlx_dspark.generate(pair, prompt, max_tokens=24)
        assert spec.tokens == plain.tokens and spec.acceptance_lengths


# -- drafts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target_family", "layer_family"),
    [("spark2_5", "qwen3"), ("spark2_5", "spark2_5"), ("qwen3", "qwen3"), ("qwen3", "spark2_5")],
)
def test_gguf_draft_of_either_layer_family_proposes_bitwise_as_its_safetensors_and_is_lossless(
    target_family, layer_family, tiny_spark_target, tiny_qwen3_target, tmp_path
):
    target = tiny_spark_target if target_family == "spark2_5" else tiny_qwen3_target
    draft = write_tiny_draft(tmp_path / "draft", target_path=target, layer_family=layer_family, seed=3)
    # A GGUF has no activation key: each layer family's graph fixes it (Qwen3-style SiLU as upstream's DSpark
    # graph, Spark-style GELU). The same draft in safetensors says so in its (copied) config.
    config = _config(draft)
    config["hidden_act"] = {"qwen3": "silu", "spark2_5": "gelu"}[layer_family]
    (draft / "config.json").write_text(json.dumps(config))
    gguf = write_gguf_draft(draft, tmp_path / "draft.gguf", target_path=target)
    from_gguf = mlx_dspark.load(target, draft=gguf)
    from_safetensors = mlx_dspark.load(target, draft=draft)
    assert from_gguf.draft.args.family == layer_family and from_gguf.draft_path == gguf
    assert _same_proposals(from_gguf, from_safetensors)
    _lossless(from_gguf)


@pytest.mark.parametrize("arch", ["dflash", "dspark"])
@pytest.mark.parametrize("include_shared", [True, False])
@pytest.mark.parametrize("tap_convention", ["plus_one", "hf"])
def test_gguf_draft_prefixes_shared_copies_and_tap_conventions_propose_as_safetensors(
    arch, include_shared, tap_convention, tiny_spark_pair, tmp_path
):
    target, draft = tiny_spark_pair
    gguf = write_gguf_draft(draft, tmp_path / "d.gguf", target_path=target, arch=arch, include_shared=include_shared,
                            tap_convention=tap_convention, mask_key="arch" if arch == "dspark" else "tokenizer")  # fmt: skip
    taps = _config(draft)["target_layer_ids"]
    # an older converter's file (HF ids unchanged) needs the override; current ones are read as HF id + 1
    pair = mlx_dspark.load(target, draft=gguf, draft_tap_ids=taps if tap_convention == "hf" else None)
    assert list(pair.draft.args.target_layer_ids) == taps
    assert _same_proposals(pair, mlx_dspark.load(target, draft=draft))
    if tap_convention == "hf":  # without the override the taps are off by one (and the proposals differ)
        assert list(mlx_dspark.load(target, draft=gguf).draft.args.target_layer_ids) == [i - 1 for i in taps]


def test_gguf_target_with_gguf_draft_is_lossless(tiny_spark_pair, tmp_path):
    target, draft = tiny_spark_pair
    pair = mlx_dspark.load(write_gguf_target(target, tmp_path / "t.gguf"), draft=write_gguf_draft(draft, tmp_path / "d.gguf", target_path=target))
    _lossless(pair)


# -- the draft's copies of the target's tensors ------------------------------------------------------


@pytest.mark.parametrize("copy_type", ["BF16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("target_kind", ["hf-bf16", "gguf-q8_0", "gguf-q4_0", "gguf-bf16"])
def test_draft_copies_in_their_storage_type_match_the_target_in_its_own(copy_type, target_kind, tmp_path):
    hf = write_tiny_target(tmp_path / "t", family="qwen3", dtype="bfloat16", seed=0)  # untied: embedding and head
    draft = write_tiny_draft(tmp_path / "d", target_path=hf, seed=1)
    copies = {"token_embd.weight": copy_type, "output.weight": copy_type}
    gguf = write_gguf_draft(draft, tmp_path / "d.gguf", target_path=hf, tensor_type="BF16", tensor_types=copies)
    target = hf if target_kind == "hf-bf16" else write_gguf_target(hf, tmp_path / "t.gguf", tensor_type=target_kind[5:].upper())
    pair = mlx_dspark.load(target, draft=gguf)
    assert pair.draft is not None and not any(k.startswith(("embed", "lm_head")) for k, _ in tree_flatten(pair.draft.parameters()))


@pytest.mark.parametrize("copy_type", ["BF16", "Q8_0"])
def test_draft_copies_of_another_target_are_refused_naming_their_storage(copy_type, tiny_qwen3_target, tmp_path):
    other = write_tiny_target(tmp_path / "other", family="qwen3", seed=5)
    draft = write_tiny_draft(tmp_path / "d", target_path=other, seed=1)
    copies = {"token_embd.weight": copy_type, "output.weight": copy_type}
    gguf = write_gguf_draft(draft, tmp_path / "d.gguf", target_path=other, tensor_types=copies)
    with pytest.raises(ValueError, match=rf"draft tensor '(embed_tokens|lm_head).weight' \(stored as {copy_type}\) differs from the target's"):
        mlx_dspark.load(tiny_qwen3_target, draft=gguf)


# -- targets -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
@pytest.mark.parametrize(("tensor_type", "dtype"), [("F32", "float32"), ("BF16", "bfloat16")])
def test_gguf_target_logits_equal_the_hugging_face_load_bitwise(family, tensor_type, dtype, tmp_path):
    hf = write_tiny_target(tmp_path / "hf", family=family, dtype=dtype, seed=2)
    gguf = write_gguf_target(hf, tmp_path / "t.gguf", tensor_type=tensor_type)
    from_gguf, from_hf = mlx_dspark.load(gguf), mlx_dspark.load(hf)
    # GGUF keeps the norms in F32: the model computes in the matrices' dtype, as the HF checkpoint does
    assert {v.dtype for _, v in tree_flatten(from_gguf.target.parameters())} == {getattr(mx, dtype)}
    assert np.array_equal(_logits(from_gguf), _logits(from_hf))
    assert from_gguf.target_path == gguf and from_gguf.target_config["model_type"] == family


def _dequantized_reference(source: Path, gguf: Path):
    """The target built from `gguf.quants.dequantize` of every GGUF tensor (llama.cpp's own values)."""
    tensors = {t.name: t for t in GGUFReader(gguf).tensors}
    globals_ = {"model.embed_tokens": "token_embd", "model.embedding": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    weights = {}
    for name, array in _read_hf_weights(source).items():
        t = tensors[gguf_name(name, layer_prefix="model.layers.", globals_=globals_)]
        weights[name] = mx.array(dequantize(t.data, t.tensor_type).reshape(array.shape))
    checkpoint = Checkpoint(config=_config(source), weights=weights, origin=dict.fromkeys(weights, gguf.name), path=gguf, config_source="reference")
    return build_target(checkpoint)


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_quantized_gguf_target_equals_its_dequantized_values_and_computes_in_bfloat16(family, kind, request, tmp_path):
    source = request.getfixturevalue(f"tiny_{'spark' if family == 'spark2_5' else 'qwen3'}_target")
    gguf = write_gguf_target(source, tmp_path / "t.gguf", tensor_type=kind)
    exact = mlx_dspark.load(gguf, dtype="float32")
    reference_logits, _ = _dequantized_reference(source, gguf)(mx.array([PROMPT]))
    np.testing.assert_allclose(_logits(exact), np.array(reference_logits), rtol=1e-4, atol=1e-4)
    assert exact.target.layers[0].mlp.down_proj.bits == (8 if kind == "Q8_0" else 4)
    default = mlx_dspark.load(gguf)  # float16 scales: bfloat16 activations unless dtype is given
    floats = {v.dtype for _, v in tree_flatten(default.target.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
    assert floats == {mx.bfloat16} and _logits(default).dtype == np.float32
    np.testing.assert_allclose(_logits(default), _logits(exact), atol=0.15 * np.abs(_logits(exact)).max())


def test_gguf_target_from_a_directory_holding_it_and_from_a_hub_file_id(tiny_qwen3_target, tmp_path, monkeypatch):
    import huggingface_hub

    (tmp_path / "dir").mkdir()
    gguf = write_gguf_target(tiny_qwen3_target, tmp_path / "dir" / "Qwen3-tiny-F32.gguf")
    expected = _logits(mlx_dspark.load(tiny_qwen3_target))
    assert np.array_equal(_logits(mlx_dspark.load(tmp_path / "dir")), expected)
    calls = []

    def fake_download(repo_id, filename):
        calls.append((repo_id, filename))
        return str(gguf)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    pair = mlx_dspark.load("SparkLLM/Qwen3-tiny-GGUF:Qwen3-tiny-F32.gguf")
    assert calls == [("SparkLLM/Qwen3-tiny-GGUF", "Qwen3-tiny-F32.gguf")] and np.array_equal(_logits(pair), expected)


# -- the tokenizer of a GGUF target ------------------------------------------------------------------


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
def test_gguf_target_without_tokenizer_files_uses_its_metadata_as_the_hf_tokenizer(family, request, tmp_path):
    source = request.getfixturevalue(f"tiny_{'spark' if family == 'spark2_5' else 'qwen3'}_target")
    (tmp_path / "alone").mkdir()
    from_gguf = mlx_dspark.load(write_gguf_target(source, tmp_path / "alone" / "t.gguf")).tokenizer
    hf = mlx_dspark.load(source).tokenizer
    specials = "".join(hf.all_special_tokens[:6])
    for text in (MIXED_TEXT * 8, specials + MIXED_TEXT + specials):
        assert from_gguf.encode(text) == hf.encode(text)
        assert from_gguf.decode(hf.encode(text)) == hf.decode(hf.encode(text))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": MIXED_TEXT}]
    assert from_gguf.apply_chat_template(chat, add_generation_prompt=True) == hf.apply_chat_template(chat, add_generation_prompt=True)
    assert set(hf.eos_token_ids) >= set(from_gguf.eos_token_ids) >= {_config(source)["eos_token_id"]}


def test_tokenizer_files_beside_the_gguf_are_preferred_over_its_metadata(tiny_spark_target, tmp_path):
    # A vendor's converter may name a pre-tokenizer we cannot rebuild: the tokenizer.json beside the file wins.
    (tmp_path / "m").mkdir()
    gguf = write_gguf_target(tiny_spark_target, tmp_path / "m" / "t.gguf", tokenizer_pre="spark-x")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre 'spark-x' is not a known pre-tokenizer.*tokenizer.json beside the GGUF file"):
        mlx_dspark.load(gguf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_spark_target / name, tmp_path / "m" / name)
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    config["chat_template"] = "BESIDE:{{ messages[0]['content'] }}"
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = mlx_dspark.load(gguf).tokenizer
    hf = mlx_dspark.load(tiny_spark_target).tokenizer
    assert tokenizer.encode(MIXED_TEXT) == hf.encode(MIXED_TEXT)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "BESIDE:hi"
    assert _config(tiny_spark_target)["eos_token_id"] in tokenizer.eos_token_ids  # eos ids from the GGUF


def test_gguf_target_without_any_tokenizer_names_the_fix(tiny_qwen3_target, tmp_path):
    (tmp_path / "m").mkdir()
    gguf = write_gguf_target(tiny_qwen3_target, tmp_path / "m" / "t.gguf", tokenizer=False)
    with pytest.raises(FileNotFoundError, match="no tokenizer.ggml.* keys and there is no tokenizer.json beside it; put the model's tokenizer.json"):
        mlx_dspark.load(gguf)


# -- bad files: one line through load() and through each command line --------------------------------


def _unknown_architecture(path: Path) -> Path:
    w = GGUFWriter(path, "gemma3")  # a language model we read from GGUF neither as a target nor as a draft model
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def _truncated(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _bad_draft(case: str, target: Path, draft: Path, tmp: Path) -> Path:
    gguf = tmp / f"{case}.gguf"
    if case == "truncated":
        return _truncated(write_gguf_draft(draft, gguf, target_path=target))
    if case == "architecture":
        return _unknown_architecture(gguf)
    if case == "missing":
        return write_gguf_draft(draft, gguf, target_path=target, drop_tensors=("blk.1.ffn_up.weight",))
    if case == "unexpected":
        return write_gguf_draft(draft, gguf, target_path=target, extra_tensors={"blk.0.attn_gate.weight": np.ones((4, 128), np.float32)})
    if case == "hidden":
        other = write_tiny_target(tmp / "narrow", family="qwen3", hidden_size=64, seed=1)
        return write_gguf_draft(write_tiny_draft(tmp / "narrow-draft", target_path=other), gguf, target_path=other, include_shared=False)
    if case == "vocabulary":
        w1 = np.zeros((500, 16), np.float32)
        return write_gguf_draft(draft, gguf, target_path=target, include_shared=False, extra_tensors={"markov_w1.weight": w1, "markov_w2.weight": w1})
    if case == "taps":
        last = write_tiny_draft(tmp / "last", target_path=target, target_layer_ids=[0, 3])
        return write_gguf_draft(last, gguf, target_path=target)
    assert case == "d2t"
    return write_gguf_draft(draft, gguf, target_path=target, extra_tensors={"d2t": np.zeros(8, np.int64)})


BAD_DRAFTS = {
    "truncated": "truncated",
    "architecture": "GGUF architecture 'gemma3' is neither a DSpark draft (dflash, dspark) nor a language model we read from "
                    "GGUF as a draft model (llama, qwen2, qwen3); for a language model, pass the model's Hugging Face id, or a "
                    "folder mlx_lm.convert made from it, as --draft",
    "missing": "missing tensor(s) ['blk.1.ffn_up.weight']",
    "unexpected": "unexpected tensor(s) ['blk.0.attn_gate.weight']",
    "hidden": "hidden_size is 64 but the target",
    "vocabulary": "vocab_size is 500 but the target",
    "taps": "target_layer_ids [0, 3] has [3] outside [-1, 2]",
    "d2t": "expected 8 rows, one per entry of 'd2t'",
}


@pytest.fixture(scope="module")
def bad_drafts(tiny_qwen3_pair, tmp_path_factory) -> dict[str, Path]:
    target, draft = tiny_qwen3_pair
    tmp = tmp_path_factory.mktemp("bad-gguf")
    return {case: _bad_draft(case, target, draft, tmp) for case in BAD_DRAFTS}


def _one_error_line(result) -> str:
    """The one `error:` line of a command that exited with status 2 (the server's progress notes aside)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("[mlx_dspark]")]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


@pytest.mark.parametrize("case", sorted(BAD_DRAFTS))
def test_bad_gguf_draft_is_one_line_through_load_and_the_generate_command(case, bad_drafts, tiny_qwen3_pair):
    from mlx_dspark.cli.generate import app

    target, _ = tiny_qwen3_pair
    path = bad_drafts[case]
    with pytest.raises(ValueError) as e:
        mlx_dspark.load(target, draft=path)
    assert BAD_DRAFTS[case] in str(e.value) and "\n" not in str(e.value)
    assert str(path) in str(e.value) or path.name in str(e.value)
    line = _one_error_line(CliRunner().invoke(app, ["--model", str(target), "--draft", str(path), "--max-tokens", "2"]))
    assert BAD_DRAFTS[case] in line


def test_bad_gguf_target_is_one_line_through_load_and_the_generate_command(tiny_qwen3_target, tmp_path):
    from mlx_dspark.cli.generate import app

    for path, message in (
        (_truncated(write_gguf_target(tiny_qwen3_target, tmp_path / "cut.gguf")), "truncated"),
        (_unknown_architecture(tmp_path / "gemma3.gguf"), "GGUF architecture 'gemma3' is not supported"),
        (write_gguf_draft(*_draft_of(tiny_qwen3_target, tmp_path), tmp_path / "d.gguf", target_path=tiny_qwen3_target),
         "this GGUF is a draft (architecture 'dflash'), but it was given as the target"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            mlx_dspark.load(path)
        assert message in _one_error_line(CliRunner().invoke(app, ["--model", str(path), "--max-tokens", "2"]))


def _draft_of(target: Path, tmp: Path) -> tuple[Path]:
    return (write_tiny_draft(tmp / "draft", target_path=target),)


# -- --draft-tap-ids in every command ----------------------------------------------------------------


@pytest.fixture(scope="module")
def older_converter_draft(tiny_spark_pair, tmp_path_factory) -> tuple[Path, Path, str]:
    """A GGUF draft whose target_layers hold the HF ids unchanged, with the flag value that fixes it."""
    target, draft = tiny_spark_pair
    gguf = write_gguf_draft(draft, tmp_path_factory.mktemp("older") / "d.gguf", target_path=target, tap_convention="hf")
    return target, gguf, ",".join(str(i) for i in _config(draft)["target_layer_ids"])


def test_generate_command_reads_a_gguf_draft_with_draft_tap_ids(older_converter_draft, tiny_spark_pair):
    from mlx_dspark.cli.generate import app

    target, gguf, taps = older_converter_draft
    common = ["--model", str(target), "--prompt", "Hello there", "--max-tokens", "12", "--json"]
    spec = CliRunner().invoke(app, [*common, "--draft", str(gguf), "--draft-tap-ids", taps])
    reference = CliRunner().invoke(app, [*common, "--draft", str(tiny_spark_pair[1])])
    plain = CliRunner().invoke(app, [*common, "--no-draft"])
    assert spec.exit_code == 0 and reference.exit_code == 0 and plain.exit_code == 0, spec.output
    spec, reference, plain = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (spec, reference, plain))
    assert spec["tokens"] == plain["tokens"] and spec["acceptance_lengths"] == reference["acceptance_lengths"]


@pytest.mark.parametrize("command", ["generate", "server", "benchmark"])
def test_every_command_takes_draft_tap_ids_into_load(command, older_converter_draft, tmp_path):
    from mlx_dspark.cli import benchmark, server
    from mlx_dspark.cli import generate as cli

    app = {"generate": cli.app, "server": server.app, "benchmark": benchmark.app}[command]
    extra = {"generate": ["--max-tokens", "2"], "server": ["--port", "0", "--log-level", "error"],
             "benchmark": ["--out", str(tmp_path / "out"), "--no-progress", "--no-mlx-lm-baseline"]}[command]  # fmt: skip
    target, gguf, taps = older_converter_draft
    base = ["--model", str(target), "--draft", str(gguf), *extra]
    line = _one_error_line(CliRunner().invoke(app, [*base, "--draft-tap-ids", "two"]))
    assert "--draft-tap-ids expects comma-separated layer ids, e.g. 2,10,18,25,33; got 'two'" in line
    line = _one_error_line(CliRunner().invoke(app, [*base, "--draft-tap-ids", "0,3"]))
    assert "draft_tap_ids [0, 3] has [3] outside [-1, 2]" in line  # reached the pair check
    # a draft that loaded with the override, stopped by the block-size check that follows the load
    line = _one_error_line(CliRunner().invoke(app, [*base, "--draft-tap-ids", taps, "--spec-draft-n-max", "8"]))
    assert "max_draft_tokens must be at most the draft's block size 7, got 8" in line


def test_draft_tap_ids_without_a_draft_is_one_line(tiny_spark_target):
    from mlx_dspark.cli.generate import app

    line = _one_error_line(CliRunner().invoke(app, ["--model", str(tiny_spark_target), "--draft-tap-ids", "0,2"]))
    assert "--draft-tap-ids applies to a draft: pass --draft as well" in line


# -- convert from GGUF -------------------------------------------------------------------------------


def _quiet(_: str) -> None:
    pass


@pytest.mark.parametrize(("tensor_type", "quantize"), [("F32", False), ("BF16", False), ("Q8_0", False), ("BF16", True)])
def test_converted_gguf_target_loads_as_the_gguf(tensor_type, quantize, tiny_spark_target, tmp_path):
    (tmp_path / "g").mkdir()
    gguf = write_gguf_target(tiny_spark_target, tmp_path / "g" / "t.gguf", tensor_type=tensor_type)
    out = convert(gguf, tmp_path / "mlx", quantize=quantize, q_group_size=32, log=_quiet)
    converted = mlx_dspark.load(out)
    original = mlx_dspark.load(gguf, quantize=4 if quantize else None, q_group_size=32)
    assert _params(converted.target).keys() == _params(original.target).keys()
    assert np.array_equal(_logits(converted), _logits(original))
    assert converted.tokenizer.encode(MIXED_TEXT) == original.tokenizer.encode(MIXED_TEXT)
    assert set(converted.tokenizer.eos_token_ids) == set(original.tokenizer.eos_token_ids)
    assert (out / "tokenizer.json").is_file() and ("quantization" in _config(out)) == (quantize or tensor_type == "Q8_0")


def test_converted_gguf_draft_loads_and_proposes_as_the_gguf_through_the_cli(older_converter_draft, tmp_path):
    from mlx_dspark.cli.convert import app

    target, gguf, taps = older_converter_draft
    out = tmp_path / "draft-mlx"
    result = CliRunner().invoke(app, ["--hf-path", str(gguf), "--mlx-path", str(out), "--draft-tap-ids", taps])
    assert result.exit_code == 0, result.output
    assert _config(out)["target_layer_ids"] == [int(i) for i in taps.split(",")]
    converted = mlx_dspark.load(target, draft=out)
    original = mlx_dspark.load(target, draft=gguf, draft_tap_ids=[int(i) for i in taps.split(",")])
    assert _same_proposals(converted, original)
    assert not (out / "tokenizer.json").exists()  # a draft uses its target's tokenizer


def test_convert_cli_reports_a_bad_gguf_in_one_line(bad_drafts, tmp_path):
    from mlx_dspark.cli.convert import app

    result = CliRunner().invoke(app, ["--hf-path", str(bad_drafts["missing"]), "--mlx-path", str(tmp_path / "o")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "missing tensor(s) ['blk.1.ffn_up.weight']" in lines[0]
    assert not (tmp_path / "o").exists()


def test_convert_keeps_float_shared_copies_and_refuses_quantized_ones(tiny_qwen3_pair, tmp_path):
    target, draft = tiny_qwen3_pair
    gguf = write_gguf_draft(draft, tmp_path / "d.gguf", target_path=target)
    out = convert(gguf, tmp_path / "kept", keep_shared=True, log=_quiet)
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(mx.load(str(out / "model.safetensors")))
    assert _same_proposals(mlx_dspark.load(target, draft=out), mlx_dspark.load(target, draft=gguf))
    copies = {"token_embd.weight": "Q8_0", "output.weight": "Q8_0"}
    quantized = write_gguf_draft(draft, tmp_path / "q.gguf", target_path=target, tensor_types=copies)
    with pytest.raises(ValueError, match=r"--keep-shared keeps .* \['embed_tokens.weight \(Q8_0\)', 'lm_head.weight \(Q8_0\)'\]"):
        convert(quantized, tmp_path / "q", keep_shared=True, log=_quiet)
