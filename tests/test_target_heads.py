"""Targets whose LM head is tied, found under another name or decided by mlx-lm at load (gemma3_text's
sanitize pops `lm_head`): one `models.heads.target_head` serves the pair check, the draft vocabulary
and export; a DSpark pair loads and its speculative greedy output is mlx-lm's own generate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.loading.pair import check_shared_tensors
from mlx_dspark.models.target.lm_head import head_is_tied, target_head
from mlx_dspark.testing.mlx_lm_checkpoints import write_tiny_mlx_lm_target
from mlx_dspark.testing.tiny import write_tiny_draft

PROMPT = [1, 5, 9, 20, 33, 7, 100, 250, 3, 64, 17, 42]
CASES = {  # family, overrides: all have tied heads; gemma4_text's is soft-capped too
    "gemma3_text": ("gemma3_text", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "gemma4_text": ("gemma4_text", {}),
    "youtu_llm": ("youtu_llm", {}),  # its mlx-lm class keeps ModelArgs as `config`, not `args`
}


def _pair(root: Path, family: str, overrides: dict) -> tuple[Path, Path]:
    target = write_tiny_mlx_lm_target(root / "target", family=family, seed=0, **overrides)
    draft = write_tiny_draft(root / "draft", target_path=target, layer_family="qwen3", seed=0)  # with the shared copies
    config_file = draft / "config.json"
    config = json.loads(config_file.read_text())
    config.update(rope_theta=10000.0, rope_parameters=None, rope_scaling=None)
    config.pop("final_logit_softcapping", None)
    config_file.write_text(json.dumps(config))
    return target, draft


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    return (family, *_pair(tmp_path_factory.mktemp(request.param), family, overrides))


def _mlx_lm_greedy(target: Path, max_tokens: int) -> list[int]:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(target))
    tokenizer.eos_token_ids = []
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=max_tokens)]


def test_the_head_is_found_and_the_draft_copy_checked(pair):
    family, target, draft = pair
    loaded = mlx_dspark.load(str(target), str(draft))
    t = loaded.target
    assert t.mlx_lm_model_type == family
    assert head_is_tied(t) and target_head(t) is t.embedding
    weight = t.embedding.weight
    assert check_shared_tensors({"lm_head.weight": weight, "embed_tokens.weight": weight}, t, draft_source="d") == {}
    with pytest.raises(ValueError, match="differs from the target's head"):
        check_shared_tensors({"lm_head.weight": weight + 0.5}, t, draft_source="d")
    h = mx.random.normal((1, 3, t.args.hidden_size))
    assert mx.allclose(t.lm_head_logits(h), t.embedding.as_linear(h), atol=1e-5).item()


def test_speculative_greedy_is_mlx_lms_generate(pair):
    _, target, draft = pair
    loaded = prepare_model(mlx_dspark.load(str(target), str(draft)), RunSettings(ignore_eos=True))
    result = mlx_dspark.generate(loaded, PROMPT, max_tokens=48)
    assert result.rounds < 48  # it speculated (a round per token would be plain decoding)
    assert result.tokens == _mlx_lm_greedy(target, 48)


BOOM = """
import runpy, sys
import mlx_dspark.loading.load as load
def boom(*args, **kwargs):
    raise AttributeError("'NoneType' object has no attribute 'weight'")
load.validate_pair = boom  # the failure of issue 33, as any unexpected exception at load
sys.argv = ["generate"] + sys.argv[1:]
runpy.run_module("mlx_dspark.generate", run_name="__main__")
"""


def test_an_unexpected_load_failure_is_one_line_through_the_cli(pair):
    """An unexpected exception while loading a pair ends the CLI with one `error:` line, exit 2."""
    _, target, draft = pair
    run = subprocess.run([sys.executable, "-c", BOOM, "--model", str(target), "--draft", str(draft), "--prompt", "hi",
                          "--max-tokens", "2"], capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], run.stderr
    assert "AttributeError" in lines[-1] and "'weight'" in lines[-1], run.stderr


def test_export_of_a_draft_without_its_copies_takes_them_from_an_mlx_lm_target(pair, tmp_path):
    # our converter leaves the draft's embedding / head copies out: export takes them from the target,
    # found on mlx-lm's class by identity (this crashed: it looked for our modules' `embed_name`)
    from mlx_dspark.export.source import EMBED, HEAD, read_draft_for_export

    family, target, _ = pair
    draft = write_tiny_draft(tmp_path / "bare", target_path=target, layer_family="qwen3", seed=0, include_shared=False)
    config_file = draft / "config.json"
    config = json.loads(config_file.read_text())
    config.update(rope_theta=10000.0, rope_parameters=None, rope_scaling=None)
    config.pop("final_logit_softcapping", None)
    config_file.write_text(json.dumps(config))
    exported = read_draft_for_export(draft, target=target)
    loaded = mlx_dspark.load(str(target))
    embedding = loaded.target.embedding.weight
    assert mx.array_equal(exported.shared[EMBED], embedding)
    assert mx.array_equal(exported.shared[HEAD], target_head(loaded.target).weight)
