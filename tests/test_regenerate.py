"""Self-distillation data (python -m mlx_dspark.train.regenerate): the target's own continuations, the
greedy / sampled mix, independence from batching, resuming, sharding over ranks, and reading it in train."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_dspark
from mlx_dspark.train.data import load_chunks
from mlx_dspark.train.distill import RegenerateOptions, mode_of, read_prompts, regenerate

TEXT = (
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n"
    "The quick brown fox jumps over the lazy dog. 1 2 3 4 5 6 7 8 9 10.\n"
)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prompts")
    (root / "doc.txt").write_text(TEXT * 3, encoding="utf-8")
    records = [{"prompt": "Write a function that adds two numbers."}, {"prompt": "Count to five:"}]
    records.append({"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "old answer"}]})
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return root


def _records(out: Path) -> dict[int, dict]:
    found = {}
    for part in sorted(out.glob("part-*.jsonl")):
        for line in part.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            assert record["index"] not in found, "an index written twice"
            found[record["index"]] = record
    return found


OPTIONS = dict(max_tokens=12, prefix_tokens=10, stride=15, greedy_fraction=0.5, seed=3)


def _run(pair, target_path, sources, out, **overrides) -> dict[int, dict]:
    options = RegenerateOptions(**{**OPTIONS, **overrides})
    regenerate(target_path, [sources], out, options=options, target=pair.target, tokenizer=pair.tokenizer, log=lambda _: None)
    return _records(out)


def test_greedy_continuations_are_the_targets_argmax_chain(tiny_qwen3_target, sources, tmp_path):
    pair = mlx_dspark.load(str(tiny_qwen3_target))
    records = _run(pair, tiny_qwen3_target, sources, tmp_path / "out", greedy_fraction=1.0)
    prompts = read_prompts([sources], pair.tokenizer, RegenerateOptions(**{**OPTIONS, "greedy_fraction": 1.0}))
    assert sorted(records) == [p.index for p in prompts] and len(prompts) > 4
    for prompt in prompts:
        ids = list(prompt.ids)
        expected = []
        for _ in range(OPTIONS["max_tokens"]):  # no cache: the full forward each time, an independent chain
            logits, _ = pair.target(mx.array([ids]))
            token = int(mx.argmax(logits[0, -1]).item())
            if token in pair.tokenizer.eos_token_ids:
                break
            expected.append(token)
            ids.append(token)
        record = records[prompt.index]
        completion = record["messages"][-1]["content"] if "messages" in record else record["completion"]
        assert completion == pair.tokenizer.decode(expected)
        assert record["mode"] == "greedy"
    chat = [r for r in records.values() if "messages" in r]
    assert len(chat) == 1 and [m["content"] for m in chat[0]["messages"]][0] == "Say hello."
    assert "old answer" not in json.dumps(chat[0])


def test_the_output_does_not_depend_on_batching_or_an_interruption(tiny_qwen3_target, sources, tmp_path):
    pair = mlx_dspark.load(str(tiny_qwen3_target))
    reference = _run(pair, tiny_qwen3_target, sources, tmp_path / "a", batch_size=8)
    modes = {r["mode"] for r in reference.values()}
    assert modes == {"greedy", "sampled"}
    assert all(r["mode"] == mode_of(i, RegenerateOptions(**OPTIONS)) for i, r in reference.items())
    assert _run(pair, tiny_qwen3_target, sources, tmp_path / "b", batch_size=1) == reference
    # interrupted: keep the first two records and half of the third line, then run again
    part = next((tmp_path / "b").glob("part-*.jsonl"))
    lines = part.read_text(encoding="utf-8").splitlines(keepends=True)
    part.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2], encoding="utf-8")
    assert _run(pair, tiny_qwen3_target, sources, tmp_path / "b", batch_size=3) == reference
    with pytest.raises(ValueError, match="other settings"):
        _run(pair, tiny_qwen3_target, sources, tmp_path / "b", max_tokens=5)


def test_train_reads_the_regenerated_records_beside_the_text(tiny_qwen3_target, sources, tmp_path):
    pair = mlx_dspark.load(str(tiny_qwen3_target))
    records = _run(pair, tiny_qwen3_target, sources, tmp_path / "out")
    chunks = load_chunks([tmp_path / "out"], pair.tokenizer, seq_len=256)
    assert len(chunks) == len(records)  # the hidden settings file is not read as text
    eos = pair.tokenizer.eos_token_id
    in_file_order = [json.loads(line) for line in next((tmp_path / "out").glob("part-*.jsonl")).read_text().splitlines()]
    assert sorted(r["index"] for r in in_file_order) == sorted(records)
    for chunk, record in zip(chunks, in_file_order):
        if "messages" in record:
            continue
        prompt_len = len(pair.tokenizer.encode(record["prompt"], add_special_tokens=True))
        assert not any(chunk.loss_mask[:prompt_len]) and all(chunk.loss_mask[prompt_len:])
        assert (chunk.tokens[-1] == eos) == record["finished"]


@pytest.mark.skipif(not mx.distributed.is_available("ring"), reason="this MLX build has no ring backend")
def test_two_ranks_share_the_prompts_and_continue_a_single_process_run(tiny_qwen3_target, sources, tmp_path):
    from tests.test_train_distributed import free_port, launcher

    pair = mlx_dspark.load(str(tiny_qwen3_target))
    reference = _run(pair, tiny_qwen3_target, sources, tmp_path / "reference")
    out = tmp_path / "shared"
    _run(pair, tiny_qwen3_target, sources, out, max_prompts=None)
    part = next(out.glob("part-*.jsonl"))
    part.write_text("".join(part.read_text(encoding="utf-8").splitlines(keepends=True)[:3]), encoding="utf-8")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS.items()]
    command = [
        *launcher(), "-n", "2", "--backend", "ring", "--hosts", "127.0.0.1", "-p", str(free_port()), "--",
        sys.executable, "-m", "mlx_dspark.train.regenerate", "--target", str(tiny_qwen3_target), "--data", str(sources),
        "--out", str(out), *flags,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.glob("part-*.jsonl")) == ["part-r000-n001.jsonl", "part-r000-n002.jsonl", "part-r001-n002.jsonl"]
    assert _records(out) == reference
