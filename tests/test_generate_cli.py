"""The `python -m mlx_dspark.generate` command line, end to end on the tiny pairs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from mlx_dspark.cli.generate import app

runner = CliRunner()


def run_cli(*args: str, stdin: str | None = None):
    return runner.invoke(app, list(args), input=stdin)


@pytest.mark.parametrize("fixture", ["tiny_spark_pair", "tiny_qwen3_pair"])
def test_json_output_of_speculative_and_plain_runs_agree(request, fixture):
    target, draft = request.getfixturevalue(fixture)
    common = ["--model", str(target), "--prompt", "Hello there", "--max-tokens", "12", "--json"]
    spec = run_cli(*common, "--draft", str(draft))
    plain = run_cli(*common, "--draft", str(draft), "--no-draft")
    assert spec.exit_code == 0, spec.output
    assert plain.exit_code == 0, plain.output
    spec_result = json.loads(spec.stdout.strip().splitlines()[-1])
    plain_result = json.loads(plain.stdout.strip().splitlines()[-1])
    assert spec_result["tokens"] == plain_result["tokens"]
    assert spec_result["speculative"] is True and plain_result["speculative"] is False
    assert spec_result["acceptance_lengths"] and plain_result["acceptance_lengths"] == []
    for key in ("text", "finish_reason", "prompt_tokens", "generation_tps", "peak_memory_gb", "mean_acceptance_length"):
        assert key in spec_result


def test_streams_text_and_prints_a_summary_to_stderr(tiny_spark_pair):
    target, draft = tiny_spark_pair
    result = run_cli("--model", str(target), "--draft", str(draft), "--prompt", "-", "--max-tokens", "6", stdin="Hi")
    assert result.exit_code == 0, result.output
    assert "mean acceptance length" in result.stderr
    assert "generation:" in result.stderr and "peak memory" in result.stderr


def test_sampling_options_and_template_switches_are_accepted(tiny_qwen3_pair):
    target, draft = tiny_qwen3_pair
    result = run_cli(
        "--model", str(target), "--draft", str(draft), "--prompt", "Hi", "--max-tokens", "6",
        "--temp", "0.8", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05", "--seed", "3",
        "--draft-sampling", "sample", "--system", "be brief", "--chat-template-args", '{"enable_thinking": false}',
        "--p-min", "0.01", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["generation_tokens"] <= 6


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "/definitely/not/here"], "does not exist"),
        (["--temp", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--draft-sampling", "beam"], "--draft-sampling"),
        (["--chat-template-args", "{not json"], "--chat-template-args"),
        (["--chat-template-args", "[1, 2]"], "JSON object"),
        (["--quantize", "3"], "--quantize"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--seed", "-1"], "--seed: seed must be an integer in [0, 2**64 - 1]"),
        (["--seed", str(2**64)], "--seed: seed must be an integer in [0, 2**64 - 1]"),
        (["--max-draft-tokens", "0"], "--max-draft-tokens: max_draft_tokens must be 'auto', an integer >= 1"),
        (["--max-draft-tokens", "often"], "--max-draft-tokens: max_draft_tokens must be 'auto' or an integer >= 1, got 'often'"),
        (["--spec-draft-n-max", "8"], "--max-draft-tokens: max_draft_tokens must be at most the draft's block size 7"),
        (["--spec-draft-p-min", "2"], "--confidence-threshold: confidence_threshold must be a number in [0, 1]"),
        (["--spec-draft-sampling", "beam"], "--draft-sampling"),
    ],
)
def test_bad_inputs_give_one_clear_line_and_a_nonzero_exit(tiny_spark_pair, extra, message):
    target, draft = tiny_spark_pair
    args = ["--model", str(target), "--draft", str(draft), "--prompt", "Hi", "--max-tokens", "4"]
    result = run_cli(*args, *extra)
    assert result.exit_code != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr


@pytest.mark.parametrize("module", ["mlx_dspark.cli.generate", "mlx_dspark.cli.server", "mlx_dspark.cli.benchmark"])
def test_every_command_takes_the_shared_generation_flags_and_llama_server_aliases(module):
    import importlib

    import typer

    command = typer.main.get_command(importlib.import_module(module).app)
    opts = {param.name: set(param.opts) for param in command.params}
    assert opts["max_draft_tokens"] == {"--max-draft-tokens", "--spec-draft-n-max", "--num-draft-tokens"}  # mlx-lm's too
    assert opts["draft"] == {"--draft", "--draft-model"}
    assert opts["p_min"] == {"--p-min"}
    # llama-server's --spec-draft-p-min is a confidence threshold for DSpark drafts (common/speculative.cpp)
    assert opts["confidence_threshold"] == {"--confidence-threshold", "--spec-draft-p-min"}
    assert opts["draft_sampling"] == {"--draft-sampling", "--spec-draft-sampling"}
    assert opts["temp"] == {"--temp", "--temperature"}
    assert {"top_p", "top_k", "min_p", "confidence_threshold"} <= set(opts)


def test_the_aliases_set_the_same_options_as_the_flags(tiny_spark_pair):
    target, draft = tiny_spark_pair
    common = ["--model", str(target), "--draft", str(draft), "--prompt", "Hello there", "--max-tokens", "16", "--json"]
    by_alias = run_cli(*common, "--spec-draft-n-max", "1", "--spec-draft-p-min", "0.5", "--spec-draft-sampling", "greedy")
    by_flag = run_cli(*common, "--max-draft-tokens", "1", "--confidence-threshold", "0.5", "--draft-sampling", "greedy")
    assert by_alias.exit_code == 0 and by_flag.exit_code == 0, by_alias.output + by_flag.output
    alias_result, flag_result = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (by_alias, by_flag))
    assert alias_result["tokens"] == flag_result["tokens"]
    # one draft token per round: each round commits at most 2 tokens
    assert alias_result["acceptance_lengths"] and max(alias_result["acceptance_lengths"]) <= 2


def test_a_draft_from_the_other_family_is_refused(tiny_spark_pair, tiny_qwen3_pair):
    result = run_cli("--model", str(tiny_spark_pair[0]), "--draft", str(tiny_qwen3_pair[1]), "--prompt", "Hi")
    assert result.exit_code != 0
    assert result.stderr.startswith("error:") and len(result.stderr.strip().splitlines()) == 1


def test_python_dash_m_entry_point_runs(tiny_spark_pair):
    target, draft = tiny_spark_pair
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_dspark.generate", "--model", str(target), "--draft", str(draft),
         "--prompt", "Hi", "--max-tokens", "5"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "generation:" in proc.stderr


# -- input that is not text, the context, Ctrl-C ----------------------------------------------------------


def one_error_line(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr


def test_invalid_utf8_on_stdin_is_one_line_and_exit_2(tiny_spark_pair):
    target, draft = tiny_spark_pair
    result = runner.invoke(app, ["--model", str(target), "--draft", str(draft), "--prompt", "-"], input=b"ok \xff\xfe")
    one_error_line(result, "standard input is not valid UTF-8 (byte 0xff at offset 3)")


def test_a_lone_surrogate_in_the_prompt_or_system_is_one_line_and_exit_2(tiny_spark_pair):
    target, draft = tiny_spark_pair
    # what Python makes of argv bytes that are not UTF-8 (surrogateescape)
    one_error_line(run_cli("--model", str(target), "--prompt", "a\udced\udca0b"), "--prompt is not valid UTF-8")
    one_error_line(run_cli("--model", str(target), "--system", "\ud800"), "--system is not valid UTF-8")


def test_the_context_is_enforced_and_a_default_max_tokens_is_clamped_to_it(tiny_spark_pair):
    target, draft = tiny_spark_pair
    args = ["--model", str(target), "--draft", str(draft), "--prompt", "Hi", "--max-context", "12", "--json"]
    one_error_line(run_cli(*args, "--max-tokens", "100"), "lower max_tokens to at most 7")  # the prompt is 5 tokens
    result = run_cli(*args)  # no --max-tokens: the default 256 is shortened to the 7 left
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["prompt_tokens"] == 5 and data["generation_tokens"] <= 7
    one_error_line(run_cli(*args, "--max-context", "1"), "--max-context: max_context must be an integer >= 2")


@pytest.mark.parametrize("where", ["load", "generation"])
def test_ctrl_c_during_load_or_generation_exits_130_without_a_traceback(tiny_spark_pair, monkeypatch, where):
    import importlib

    load_module = importlib.import_module("mlx_dspark.loading.load")  # the package attribute `load` is the function
    api_module = importlib.import_module("mlx_dspark.api")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def interrupted_stream(*args, **kwargs):
        yield from []
        raise KeyboardInterrupt

    if where == "load":
        monkeypatch.setattr(load_module, "load", interrupted)
    else:
        monkeypatch.setattr(api_module, "stream_generate", interrupted_stream)
    target, draft = tiny_spark_pair
    result = run_cli("--model", str(target), "--draft", str(draft), "--prompt", "Hi")
    assert result.exit_code == 130 and "interrupted" in result.stderr and "Traceback" not in result.output


def test_sigint_during_generation_exits_130_without_a_traceback(tiny_spark_pair):
    import signal

    target, draft = tiny_spark_pair
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_dspark.generate", "--model", str(target), "--draft", str(draft),
         "--prompt", "Count to ten", "--max-tokens", "3000"],  # the tiny pair writes ~1000 tokens to it
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout.read(1)  # generating
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr.decode()
    assert b"Traceback" not in stderr and b"interrupted" in stderr


def test_without_a_model_it_runs_the_shipped_demo_pair_on_its_python_prompt():
    result = run_cli("--max-tokens", "24", "--json")
    assert result.exit_code == 0, result.output
    assert "no --model given: the demo pair" in result.stderr and "class Request:" in result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["speculative"] is True and out["generation_tokens"] == 24
    assert out["mean_acceptance_length"] > 1.5  # a trained draft (a random one gives about 1.0)


def test_a_missing_demo_pair_is_one_clear_line(monkeypatch, tmp_path):
    from mlx_dspark.cli import demo
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path / "demo")
    result = run_cli("--max-tokens", "4")
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: the demo pair is not installed") and "--model" in lines[0]


def test_spec_draft_p_min_is_the_confidence_threshold_as_in_llama_server(tiny_spark_pair, tmp_path):
    """llama-server's --spec-draft-p-min stops a DSpark proposal at the first confidence below it: at 1
    (a sigmoid never reaches it) no draft is ever verified, while --p-min 0 leaves proposals whole."""
    from mlx_dspark.testing.tiny import write_tiny_draft

    target, draft = tiny_spark_pair
    common = ["--model", str(target), "--draft", str(draft), "--prompt", "Hello there", "--max-tokens", "12", "--json"]
    cut = run_cli(*common, "--spec-draft-p-min", "1")
    whole = run_cli(*common, "--p-min", "0", "--spec-draft-n-max", "7")
    assert cut.exit_code == 0 and whole.exit_code == 0, cut.output + whole.output
    cut_result, whole_result = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (cut, whole))
    assert set(cut_result["acceptance_lengths"]) == {1}
    assert cut_result["tokens"] == whole_result["tokens"]  # greedy output is the target's either way
    no_head = write_tiny_draft(tmp_path / "no-head", target_path=target, enable_confidence_head=False)
    refused = run_cli("--model", str(target), "--draft", str(no_head), "--prompt", "Hi", "--spec-draft-p-min", "0.5")
    assert refused.exit_code != 0
    assert "confidence_threshold 0.5 needs a draft with a confidence head" in refused.output
    assert "set it to 0" in refused.output


def test_the_demo_prompt_goes_raw_unless_the_template_is_asked_for():
    raw = json.loads(run_cli("--max-tokens", "2", "--json").stdout.strip().splitlines()[-1])
    templated = run_cli("--chat-template", "--max-tokens", "2", "--json")
    assert templated.exit_code == 0 and "prompt (through the chat template)" in templated.stderr
    # the template's markers around the same text: more prompt tokens than the raw prompt
    assert json.loads(templated.stdout.strip().splitlines()[-1])["prompt_tokens"] > raw["prompt_tokens"]
