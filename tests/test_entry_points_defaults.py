"""Every command-line entry point with its defaults, as a subprocess, on the demo pair and on a tiny
fixture pair: a non-zero exit or a traceback fails. Only what a command requires is given, plus the
sizes (tokens, prompts, steps) that keep a run short; the speculation settings are always the
defaults (auto draft length, lookup on, batching on), since those are what broke before.

Each run gets a fresh, empty cost-cache directory (a user's first run measures the curve)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import mlx_dspark

DEMO = Path(mlx_dspark.__file__).parent / "demo"


def run(args: list[str], tmp_path: Path, *, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLX_DSPARK_COST_DIR": str(tmp_path / "costs"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                            cwd=tmp_path, env=env)  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


def ok(args: list[str], tmp_path: Path, **kwargs) -> subprocess.CompletedProcess:
    result = run(args, tmp_path, **kwargs)
    assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_benchmark_with_its_defaults_on_the_demo_pair(tmp_path):
    # The demo's text repeats: lookup blocks longer than the draft's block land (the crash of issue 33.1;
    # test_benchmark.py checks the histogram of such rounds without depending on auto's choices)
    ok(["mlx_dspark.benchmark", "--datasets", "humaneval", "--prompts-per-dataset", "2", "--no-progress"], tmp_path)
    results = json.loads((tmp_path / "benchmark-results" / "results.json").read_text())
    for record in results["prompts"]:
        assert sum(record["dspark"]["acceptance_histogram"]) == record["dspark"]["rounds"]
        mean = record["dspark"]["mean_acceptance_length"]
        assert mean == round(mean, 3)


def test_benchmark_calibrate_and_generate_with_their_defaults_on_a_tiny_pair(tiny_qwen3_pair, tmp_path):
    target, draft = map(str, tiny_qwen3_pair)
    ok(["mlx_dspark.benchmark", "--model", target, "--draft", draft, "--datasets", "gsm8k", "--prompts-per-dataset", "1",
        "--max-tokens", "24", "--no-progress"], tmp_path)  # fmt: skip
    calibrated = ok(["mlx_dspark.calibrate", "--model", target, "--draft", draft], tmp_path)
    assert re.search(r"verify of 1\.\.(8|33) tokens", calibrated.stdout)
    generated = ok(["mlx_dspark.generate", "--model", target, "--draft", draft, "--prompt", "hello", "--max-tokens", "16"], tmp_path)
    assert "prompt:" in generated.stderr


def test_calibrate_with_its_defaults_measures_the_demo_pair(tmp_path):
    result = ok(["mlx_dspark.calibrate"], tmp_path)
    assert "draft block" in result.stdout and re.search(r"verify of 1\.\.33 tokens", result.stdout)  # 33: a lookup block and its anchor


@pytest.mark.slow
def test_convert_export_and_train_with_their_defaults(tiny_qwen3_pair, tmp_path):
    ok(["mlx_dspark.convert", "--hf-path", str(DEMO / "target"), "--mlx-path", str(tmp_path / "target-mlx")], tmp_path)
    ok(["mlx_dspark.convert", "--hf-path", str(DEMO / "draft"), "--mlx-path", str(tmp_path / "draft-mlx")], tmp_path)
    for name in ("vocab_rank.json", "calibration.json", "training.json"):  # the draft's own files travel with it
        assert (tmp_path / "draft-mlx" / name).read_bytes() == (DEMO / "draft" / name).read_bytes(), name
    # the converted demo pair behaves as the demo: raw-text prompts, and --dtype loads it as the demo loads
    converted = ok(["mlx_dspark.generate", "--model", str(tmp_path / "target-mlx"), "--draft", str(tmp_path / "draft-mlx"),
                    "--dtype", "float32", "--prompt", "def f(x):", "--max-tokens", "16", "--json"], tmp_path)  # fmt: skip
    shipped = ok(["mlx_dspark.generate", "--prompt", "def f(x):", "--max-tokens", "16", "--json"], tmp_path)
    converted, shipped = json.loads(converted.stdout), json.loads(shipped.stdout)
    assert converted["prompt_tokens"] == shipped["prompt_tokens"] and converted["tokens"] == shipped["tokens"]
    bad = run(["mlx_dspark.convert", "--hf-path", str(tmp_path / "absent"), "--mlx-path", str(tmp_path / "x")], tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("error:")
    ok(["mlx_dspark.export", str(DEMO / "draft"), str(tmp_path / "draft.gguf"), "--to", "gguf", "--target", str(DEMO / "target")],
       tmp_path)
    target, _ = tiny_qwen3_pair
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 40)
    ok(["mlx_dspark.train", "--target", str(target), "--data", str(corpus), "--out", str(tmp_path / "trained"),
        "--steps", "2", "--batch-size", "1", "--seq-len", "64", "--anchors", "4", "--no-progress"], tmp_path)  # fmt: skip
    assert (tmp_path / "trained" / "config.json").is_file()


def test_chat_with_its_defaults_on_a_tiny_pair(tiny_tools_pair, tmp_path):
    target, draft = map(str, tiny_tools_pair)
    ok(["mlx_dspark.chat", "--model", target, "--draft", draft, "--max-tokens", "8"], tmp_path, stdin="hi\n")


def _post(url: str, path: str, body: dict, headers: dict | None = None) -> dict:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_the_server_with_its_defaults_answers_each_api_on_the_demo_pair(tmp_path):
    env = {**os.environ, "MLX_DSPARK_COST_DIR": str(tmp_path / "costs"), "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen([sys.executable, "-m", "mlx_dspark.server", "--port", "0"], stderr=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, text=True, cwd=tmp_path, env=env)  # fmt: skip
    log: list[str] = []
    try:
        url = None
        while url is None:
            line = server.stderr.readline()
            assert line or server.poll() is None, "".join(log)
            log.append(line)
            found = re.search(r"listening on (http://[\d.]+:\d+)", line)
            url = found.group(1) if found else None
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if json.loads(response.read())["status"] == "ok":
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server never said ok on /health"
            time.sleep(0.2)
        chat = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "def f():"}], "max_tokens": 16})
        assert chat["usage"]["completion_tokens"] >= 1
        text = _post(url, "/v1/completions", {"prompt": "def f():", "max_tokens": 16})
        assert text["choices"][0]["text"]
        message = _post(url, "/v1/messages", {"model": "claude", "max_tokens": 16,
                                              "messages": [{"role": "user", "content": "def f():"}]})  # fmt: skip
        assert message["type"] == "message"
        response = _post(url, "/v1/responses", {"input": "def f():", "max_output_tokens": 16})
        assert response["object"] == "response"
    finally:
        server.send_signal(signal.SIGINT)
        _, rest = server.communicate(timeout=30)
    stderr = "".join(log) + rest
    assert "Traceback" not in stderr, stderr[-3000:]
    assert server.returncode == 0, stderr[-3000:]


def test_an_unexpected_error_at_load_is_one_line(tmp_path):
    bad = tmp_path / "bad-target"
    bad.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (bad / name).write_bytes((DEMO / "target" / name).read_bytes())
    config = json.loads((DEMO / "target" / "config.json").read_text())
    config["num_attention_heads"] = "four"  # a wrong type deep in the model class: no check of ours expects it
    (bad / "config.json").write_text(json.dumps(config))
    for command in (["mlx_dspark.generate", "--model", str(bad), "--no-draft"],
                    ["mlx_dspark.calibrate", "--model", str(bad), "--draft", str(DEMO / "draft")]):
        result = run(command, tmp_path)
        assert result.returncode == 2
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "TypeError" in errors[0] and str(bad) in errors[0], result.stderr


def test_auto_draft_without_a_network_fails_fast_and_says_so(tmp_path):
    # a closed port stands for a dead network: one quick line naming the Hub, not five retries and "no known draft"
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "mlx_dspark.generate", "--model", "someone/Unknown-7B", "--draft", "auto"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)  # fmt: skip
    assert time.monotonic() - start < 20
    assert result.returncode == 2 and "cannot reach the Hugging Face Hub" in result.stderr, result.stderr


def test_a_model_without_a_draft_says_it_runs_without_one(tiny_qwen3_target, tmp_path):
    result = ok(["mlx_dspark.generate", "--model", str(tiny_qwen3_target), "--prompt", "hi", "--max-tokens", "4"], tmp_path)
    assert "running without a draft: no known draft for" in result.stderr


def test_no_draft_with_lookup_named_runs_lookup_alone(tmp_path):
    plain = json.loads(ok(["mlx_dspark.generate", "--no-draft", "--json", "--max-tokens", "96"], tmp_path).stdout)
    named = ok(["mlx_dspark.generate", "--no-draft", "--lookup", "on", "--json", "--max-tokens", "96"], tmp_path)
    assert "prompt-lookup drafts alone" in named.stderr
    named = json.loads(named.stdout)
    assert named["tokens"] == plain["tokens"]
    assert plain["target_forwards"] == 96 and named["target_forwards"] < 96  # the demo's text repeats: lookups land


def test_generate_with_its_defaults_and_a_json_schema_on_a_tiny_dflash2_pair(tiny_qwen3_pair, tmp_path):
    from mlx_dspark.testing.dflash2_tiny import write_dflash2_draft

    target, deepspec = tiny_qwen3_pair
    draft = str(write_dflash2_draft(deepspec, tmp_path / "dflash2", seed=4))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    result = ok(["mlx_dspark.generate", "--model", str(target), "--draft", draft, "--prompt", "hello", "--max-tokens", "24",
                 "--json-schema", str(schema), "--compare"], tmp_path)  # fmt: skip
    assert "outputs identical: yes" in result.stderr
