"""`python -m mlx_dspark.chat`, fed through stdin in a subprocess, on the tiny spark pair (greedy)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_dspark.api import generate
from mlx_dspark.loading.load import load

REPO = Path(__file__).resolve().parents[1]
SYSTEM = "You answer briefly."
MAX_TOKENS = 12
STATS = re.compile(r"^\[prompt (\d+) tokens, (\d+) cached, .* tok/s \| reply (\d+) tokens, .*\]$")


def run_chat(pair, stdin: str, *extra: str) -> subprocess.CompletedProcess:
    target, draft = pair
    command = [sys.executable, "-m", "mlx_dspark.chat", "--model", str(target), "--draft", str(draft),
               "--system", SYSTEM, "--max-tokens", str(MAX_TOKENS), *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8"}
    # bytes, not text: a reply of the random model may hold a "\r" that universal newlines would rewrite
    return subprocess.run(command, input=stdin.encode(), capture_output=True, timeout=120, env=env)


def stats(stderr: bytes) -> list[tuple[int, int, int]]:
    lines = [STATS.match(line) for line in stderr.decode().splitlines()]
    return [tuple(int(g) for g in m.groups()) for m in lines if m]


@pytest.fixture(scope="module")
def pair(tiny_spark_pair):
    target, draft = tiny_spark_pair
    return load(target, draft=draft)


def test_a_chat_keeps_its_cache_between_turns_and_replies_as_cold_generations(tiny_spark_pair, pair):
    proc = run_chat(tiny_spark_pair, "Tell me about the sea.\nAnd then?\n/reset\nHello\n")
    assert proc.returncode == 0, proc.stderr.decode()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about the sea."}]
    first = generate(pair, messages, max_tokens=MAX_TOKENS)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    second = generate(pair, messages, max_tokens=MAX_TOKENS)
    after_reset = generate(pair, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}],
                           max_tokens=MAX_TOKENS)  # fmt: skip
    assert proc.stdout.decode() == f"{first.text}\n{second.text}\n{after_reset.text}\n"
    turns = stats(proc.stderr)
    assert [t[0] for t in turns] == [first.prompt_tokens, second.prompt_tokens, after_reset.prompt_tokens]
    assert turns[0][1] == 0 and turns[1][1] > 0 and turns[2][1] == 0  # /reset: a new, empty cache
    assert turns[1][1] >= first.prompt_tokens - 1
    assert [t[2] for t in turns] == [len(first.tokens), len(second.tokens), len(after_reset.tokens)]


def test_exit_quits_and_plain_decoding_gives_the_same_replies(tiny_spark_pair, pair):
    proc = run_chat(tiny_spark_pair, "Hello\n/exit\nnever read\n", "--no-draft")
    assert proc.returncode == 0, proc.stderr.decode()
    want = generate(pair, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}],
                    max_tokens=MAX_TOKENS)  # fmt: skip
    assert proc.stdout.decode() == f"{want.text}\n"
    assert len(stats(proc.stderr)) == 1 and "mean acceptance length" not in proc.stderr.decode()


def test_a_bad_flag_is_one_error_line(tiny_spark_pair):
    proc = run_chat(tiny_spark_pair, "", "--temp", "-1")
    assert proc.returncode == 2
    assert proc.stderr.decode().startswith("error: --temp") and len(proc.stderr.decode().strip().splitlines()) == 1


def test_without_a_model_it_chats_with_the_demo_pair_through_its_template():
    from mlx_dspark.cli.common import demo_pair

    demo = demo_pair()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8"}
    result = subprocess.run([sys.executable, "-m", "mlx_dspark.chat", "--max-tokens", "8"], input=b"def add(a, b):\n",
                            capture_output=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr.decode()
    pair = load(demo.target, draft=demo.draft, dtype=demo.dtype)
    want = generate(pair, [{"role": "user", "content": "def add(a, b):"}], max_tokens=8)
    assert result.stdout.decode() == f"{want.content}\n"
    assert len(stats(result.stderr)) == 1


def test_tools_from_a_file_reach_the_template_and_a_bad_file_is_one_error_line(tiny_tools_pair, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]))
    plain = run_chat(tiny_tools_pair, "Hello\n")
    with_tools = run_chat(tiny_tools_pair, "Hello\n", "--tools", str(tools))
    assert with_tools.returncode == 0, with_tools.stderr.decode()
    assert stats(with_tools.stderr)[0][0] > stats(plain.stderr)[0][0]  # the tool definitions are in the prompt
    tools.write_text('[{"type": "function", "function": {"name": "a b"}}]')
    bad = run_chat(tiny_tools_pair, "Hello\n", "--tools", str(tools))
    assert bad.returncode == 2 and bad.stderr.decode().strip().splitlines()[-1].startswith("error: 'tools[0].function.name'")


def test_reasoning_prints_between_thinking_marks(tiny_spark_pair, pair):
    proc = run_chat(tiny_spark_pair, "Hello\n", "--chat-template-args", '{"thinking_effort": "high"}')
    assert proc.returncode == 0, proc.stderr.decode()
    want = generate(pair, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}],
                    max_tokens=MAX_TOKENS, chat_template_kwargs={"thinking_effort": "high"})
    assert want.reasoning  # the template opened <think>: the reply starts as reasoning
    shown = f"[thinking] {want.reasoning}" + (f" [/thinking]\n{want.content}\n" if want.content else " [/thinking]\n")
    assert proc.stdout.decode() == shown


def test_no_draft_with_lookup_named_chats_with_lookup_alone(tiny_spark_pair, pair):
    # issue 39.4: --no-draft alone is the plain baseline; with --lookup named, lookup drafts run alone
    proc = run_chat(tiny_spark_pair, "Hello\n", "--no-draft", "--lookup", "on")
    assert proc.returncode == 0, proc.stderr.decode()
    assert "--no-draft --lookup on: no DSpark draft, prompt-lookup drafts alone" in proc.stderr.decode()
    assert "mean acceptance length" in proc.stderr.decode()  # speculative rounds, not plain decoding
    want = generate(pair, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}],
                    max_tokens=MAX_TOKENS, speculative=False)  # fmt: skip
    assert proc.stdout.decode() == f"{want.text}\n"
