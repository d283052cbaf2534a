"""The commands on a target run by mlx-lm's own model class (a tiny llama, MiniCPM5's architecture, and
a tiny qwen3_moe): `generate`, the server with tools, the benchmark against mlx-lm, `convert -q`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mlx_dspark
from mlx_dspark.api import encode_prompt, generate
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.cli.benchmark import app as benchmark_app
from mlx_dspark.cli.convert import app as convert_app
from mlx_dspark.cli.generate import app as generate_app
from mlx_dspark.testing.mlx_lm_checkpoints import write_tiny_mlx_lm_target
from mlx_dspark.testing.tiny_tokenizer import tools_chat_template, write_chat_template
from tests.test_mlx_lm_targets import PROMPT, mlx_lm_greedy, write_pair
from tests.test_server import call, pair_loader, running_server
from tests.test_server_agents import HISTORY, WEATHER


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory) -> tuple[Path, Path]:
    target, draft = write_pair(tmp_path_factory.mktemp("llama"), "llama")
    write_chat_template(target, tools_chat_template())  # Qwen3's <tool_call> JSON format (mlx-lm's json_tools)
    return target, draft


def test_generate_cli_runs_a_llama_target_with_its_draft(llama_pair):
    target, draft = llama_pair
    common = ["--model", str(target), "--prompt", "Hello there", "--max-tokens", "16", "--json"]
    spec = CliRunner().invoke(generate_app, [*common, "--draft", str(draft)])
    plain = CliRunner().invoke(generate_app, [*common, "--draft", str(draft), "--no-draft"])
    assert spec.exit_code == 0 and plain.exit_code == 0, spec.output + plain.output
    spec_result, plain_result = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (spec, plain))
    assert spec_result["speculative"] and spec_result["acceptance_lengths"]
    assert spec_result["tokens"] == plain_result["tokens"] and len(spec_result["tokens"]) > 0


def test_server_answers_a_chat_with_tools_as_the_api_does(llama_pair):
    with running_server(pair_loader(llama_pair)) as server:
        body = {"model": "tiny-spark", "messages": HISTORY, "tools": [WEATHER], "max_tokens": 12}
        status, _, reply = call(server, "POST", "/v1/chat/completions", body)
        want = generate(server.worker.model, HISTORY, tools=[WEATHER], max_tokens=12)
    assert status == 200, reply
    tokenizer = server.worker.model.tokenizer
    assert reply["usage"]["prompt_tokens"] == len(encode_prompt(tokenizer, HISTORY, tools=[WEATHER])) > len(encode_prompt(tokenizer, HISTORY))
    message = reply["choices"][0]["message"]
    assert (message["content"] or "") == (want.content or "")
    assert reply["usage"]["completion_tokens"] == len(want.tokens)


def test_benchmark_compares_with_mlx_lms_own_model(llama_pair, tmp_path):
    target, draft = llama_pair
    args = ["--model", str(target), "--draft", str(draft), "--datasets", "gsm8k", "--prompts-per-dataset", "1",
            "--max-tokens", "8", "--ignore-eos", "--out", str(tmp_path / "out"), "--no-progress", "--parity-repeats", "1"]  # fmt: skip
    result = CliRunner().invoke(benchmark_app, args)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["meta"]["mlx_lm_baseline"] == "mlx_lm.load"
    assert [p["mlx_lm"]["tokens_match_baseline"] for p in results["prompts"]] == [True]
    assert results["rows"][0]["greedy_identical"] == 1.0


def test_convert_q_of_a_moe_target_is_what_mlx_lm_quantizes(tmp_path):
    source = write_tiny_mlx_lm_target(tmp_path / "moe", family="qwen3_moe")
    out = tmp_path / "moe-4bit"
    result = CliRunner().invoke(convert_app, ["--hf-path", str(source), "--mlx-path", str(out), "-q"])
    assert result.exit_code == 0, result.output
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    # mlx-lm's qwen3_moe keeps its routers at 8 bits; the per-layer entries say so, as mlx-lm writes them
    assert quantization["bits"] == 4 and quantization["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    loaded = prepare_model(mlx_dspark.load(str(out)), RunSettings(ignore_eos=True))
    assert mlx_dspark.generate(loaded, PROMPT, max_tokens=40, speculative=False).tokens == mlx_lm_greedy(out, PROMPT, 40)


def test_mlx_lm_quantized_checkpoints_and_load_time_quantize_give_mlx_lms_tokens(tmp_path):
    from mlx_lm import convert as mlx_lm_convert

    source = write_tiny_mlx_lm_target(tmp_path / "moe", family="qwen3_moe")
    quantized = tmp_path / "mlx-lm-4bit"
    mlx_lm_convert(str(source), str(quantized), quantize=True, q_bits=4, q_group_size=64)  # routers at 8 bits
    reference = mlx_lm_greedy(quantized, PROMPT, 40)
    for path, quantize in ((quantized, None), (source, 4)):
        loaded = prepare_model(mlx_dspark.load(str(path), quantize=quantize), RunSettings(ignore_eos=True))
        assert mlx_dspark.generate(loaded, PROMPT, max_tokens=40, speculative=False).tokens == reference
