"""The HF -> MLX converter: exact round trips, shards, dtype, drafts, and its CLI."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from mlx_dspark.cli.convert import app
from mlx_dspark.loading.convert import convert
from mlx_dspark.loading.load import load
from mlx_dspark.testing.tiny import write_tiny_target

PROMPT = mx.array([[5, 17, 42, 99, 300, 7, 11, 200, 3, 64, 128, 250, 31, 8, 90, 101, 77, 12, 140, 19, 23]])


def _quiet(_: str) -> None:
    pass


def _logits(model) -> np.ndarray:
    return np.array(model(PROMPT)[0].astype(mx.float32))


def _params(model) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def _pair(family, spark, qwen3):
    return spark if family == "spark2_5" else qwen3


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
def test_round_trip_gives_exactly_the_hf_logits_and_draft(family, tiny_spark_pair, tiny_qwen3_pair, tmp_path):
    target, draft = _pair(family, tiny_spark_pair, tiny_qwen3_pair)
    mlx_target = convert(target, tmp_path / "t", log=_quiet)
    mlx_draft = convert(draft, tmp_path / "d", log=_quiet)
    direct, converted = load(target, draft), load(mlx_target, mlx_draft)
    np.testing.assert_array_equal(_logits(converted.target), _logits(direct.target))
    a, b = _params(converted.draft), _params(direct.draft)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert converted.tokenizer.encode("round trip") == direct.tokenizer.encode("round trip")
    assert converted.tokenizer.eos_token_ids == direct.tokenizer.eos_token_ids


def test_converted_draft_drops_shared_tensors_unless_keep_shared(tiny_qwen3_pair, tmp_path):
    target, draft = tiny_qwen3_pair
    dropped = convert(draft, tmp_path / "dropped", log=_quiet)
    kept = convert(draft, tmp_path / "kept", keep_shared=True, log=_quiet)
    dropped_names = set(json.loads((dropped / "model.safetensors.index.json").read_text())["weight_map"])
    kept_names = set(json.loads((kept / "model.safetensors.index.json").read_text())["weight_map"])
    assert kept_names - dropped_names == {"embed_tokens.weight", "lm_head.weight"}
    assert load(target, kept).draft is not None


def test_tied_spark_target_converts_without_an_lm_head(tiny_spark_target, tmp_path):
    out = convert(tiny_spark_target, tmp_path / "t", log=_quiet)
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.embedding.weight" in names and "lm_head.weight" not in names
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (tiny_spark_target / name).read_bytes()


@pytest.mark.parametrize("family", ["spark2_5", "qwen3"])
def test_sharded_input_and_output_load_identically(family, tiny_spark_target, tiny_qwen3_target, tmp_path):
    reference = _logits(load(_pair(family, tiny_spark_target, tiny_qwen3_target)).target)
    sharded_hf = write_tiny_target(tmp_path / "hf", family=family, seed=0, num_shards=4)
    out = convert(sharded_hf, tmp_path / "mlx", max_shard_bytes=200_000, log=_quiet)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards  # no temporary files left
    np.testing.assert_array_equal(_logits(load(out).target), reference)


def test_dtype_option_writes_bf16_weights_and_config(tiny_qwen3_target, tmp_path):
    out = convert(tiny_qwen3_target, tmp_path / "bf16", dtype="bfloat16", log=_quiet)
    assert {v.dtype for v in mx.load(str(out / "model.safetensors")).values()} == {mx.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    np.testing.assert_array_equal(
        _logits(load(out).target), _logits(load(tiny_qwen3_target, dtype="bfloat16").target)
    )


def test_progress_goes_to_the_log(tiny_qwen3_target, tmp_path):
    lines: list[str] = []
    convert(tiny_qwen3_target, tmp_path / "o", log=lines.append)
    assert lines[0].startswith("shard 1/1 model.safetensors") and "tensors" in lines[-1]


# -- CLI ------------------------------------------------------------------------------------------


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_cli_converts_and_reports_progress_on_stderr(tiny_qwen3_target, tmp_path):
    result = _run("--hf-path", str(tiny_qwen3_target), "--mlx-path", str(tmp_path / "o"), "-q", "--q-bits", "8")
    assert result.exit_code == 0, result.output
    assert "shard 1/1" in result.stderr and "wrote" in result.stderr
    assert json.loads((tmp_path / "o" / "config.json").read_text())["quantization"]["bits"] == 8


def test_cli_refuses_a_non_empty_destination_without_force(tiny_qwen3_target, tmp_path):
    dst = tmp_path / "o"
    dst.mkdir()
    (dst / "something").write_text("x")
    result = _run("--hf-path", str(tiny_qwen3_target), "--mlx-path", str(dst))
    assert result.exit_code == 2  # bad input: exit status 2, as every command
    assert result.stderr.strip().splitlines() == [f"error: destination {dst} is not empty; pass --force to overwrite it"]
    assert _run("--hf-path", str(tiny_qwen3_target), "--mlx-path", str(dst), "--force").exit_code == 0
    assert (dst / "config.json").is_file()


def test_force_replaces_stale_shards(tiny_qwen3_target, tmp_path):
    dst = tmp_path / "o"
    convert(tiny_qwen3_target, dst, max_shard_bytes=100_000, log=_quiet)
    convert(tiny_qwen3_target, dst, force=True, log=_quiet)
    assert sorted(p.name for p in dst.glob("*.safetensors")) == ["model.safetensors"]
    load(dst)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-q", "--q-bits", "3"], "error: --q-bits must be one of 4, 8, got 3"),
        (["-q", "--q-group-size", "48"], "error: --q-group-size must be one of 32, 64, 128, got 48"),
        (["--q-bits", "8"], "error: --q-bits / --q-group-size only apply with -q/--quantize"),
        (["--dtype", "int8"], "error: --dtype must be one of bfloat16, float16, float32, got 'int8'"),
    ],
)
def test_cli_bad_options_fail_with_one_line(tiny_qwen3_target, tmp_path, args, message):
    result = _run("--hf-path", str(tiny_qwen3_target), "--mlx-path", str(tmp_path / "o"), *args)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [message]
    assert not (tmp_path / "o").exists()


def test_cli_missing_source_fails_with_one_line(tmp_path):
    result = _run("--hf-path", str(tmp_path / "nope"), "--mlx-path", str(tmp_path / "o"))
    assert result.exit_code == 2  # bad input: exit status 2, as every command
    assert result.stderr.strip().splitlines() == [f"error: source directory {tmp_path / 'nope'} does not exist"]


def test_module_entry_point_runs(tiny_qwen3_target, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_dspark.convert", "--hf-path", str(tiny_qwen3_target), "--mlx-path", str(tmp_path / "o"), "-q", "--q-bits", "5"],
        capture_output=True, text=True, cwd=repo, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --q-bits must be one of 4, 8, got 5"
