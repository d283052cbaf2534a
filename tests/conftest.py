"""Shared pytest fixtures: tiny random checkpoints written once per session.

Everything is float32 and seeded (seed 0), written by `mlx_dspark.testing.tiny`; treat the directories as
read-only (they are shared by every test of the session; write your own with the writer to modify).

- `tiny_spark_target`: Path of a spark2_5 target (tied, 4 layers: 3 sliding + 1 full, window 16,
  hidden 128, 4 query / 2 KV heads of 64, partial rotary 0.25 on the full layer, vocab 384).
- `tiny_qwen3_target`: Path of a qwen3 target (untied, 4 layers, hidden 128, heads 4 x 32, vocab 384).
- `tiny_spark_pair`, `tiny_qwen3_pair`: (target_path, draft_path); the draft is a vanilla-Markov DSpark
  draft with a confidence head, 2 sliding layers (window 16), taps [0, 2], block size 7, mask token =
  the tokenizer's `<|mask|>`, and the shared embedding / lm_head copied in (HF / DeepSpec layout).
- `tiny_tools_pair`: the qwen3 pair with a ChatML template that renders tools (Qwen3's `<tool_call>` JSON
  format, mlx-lm's `json_tools` parser; `testing.tiny_tokenizer.tools_chat_template`) and thinking.
- `shared_fixtures`: Path of ../shared/fixtures (the reference tiny checkpoints); skips when absent.

Spark directories carry `auto_map` like the real checkpoint: load their tokenizer with
`mlx_dspark.load` (or pass `{"trust_remote_code": False}` to mlx-lm's `load_tokenizer`), never by
letting transformers prompt for custom code.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mlx_dspark.testing.tiny import write_tiny_draft, write_tiny_target
from mlx_dspark.testing.tiny_tokenizer import tools_chat_template, write_chat_template

SHARED_DIR = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def tiny_spark_target(tmp_path_factory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("tiny-spark") / "target", family="spark2_5", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_target(tmp_path_factory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("tiny-qwen3") / "target", family="qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_spark_pair(tiny_spark_target) -> tuple[Path, Path]:
    draft = write_tiny_draft(tiny_spark_target.parent / "draft", target_path=tiny_spark_target, seed=0)
    return tiny_spark_target, draft


@pytest.fixture(scope="session")
def tiny_qwen3_pair(tiny_qwen3_target) -> tuple[Path, Path]:
    draft = write_tiny_draft(tiny_qwen3_target.parent / "draft", target_path=tiny_qwen3_target, seed=0)
    return tiny_qwen3_target, draft


@pytest.fixture(scope="session")
def tiny_tools_pair(tiny_qwen3_pair, tmp_path_factory) -> tuple[Path, Path]:
    target, draft = tiny_qwen3_pair
    copy = shutil.copytree(target, tmp_path_factory.mktemp("tiny-tools") / "target")
    write_chat_template(copy, tools_chat_template())
    return copy, draft


@pytest.fixture(scope="session")
def shared_fixtures() -> Path:
    path = SHARED_DIR / "fixtures"
    if not path.is_dir():
        pytest.skip(f"shared reference fixtures not found at {path} (the folder beside the repo checkout)")
    return path


@pytest.fixture(autouse=True)
def synthetic_cost_curves(tmp_path_factory, monkeypatch):
    """Tests never time anything: a pair's cost curve (for the default `max_draft_tokens="auto"`) is a flat
    synthetic one (every verify width costs the same, drafts are free: auto proposes full blocks while any
    draft is accepted), cached in a per-session directory instead of ~/.cache (also for CLI subprocesses,
    which inherit $MLX_DSPARK_COST_DIR but measure the pairs for real). The synthetic curves live in a
    subdirectory of their own: a real curve a subprocess cached (the demo pair's, where auto parks on a slow
    CPU) must not reach a later in-process test that expects the flat one (an order-dependent failure)."""
    from mlx_dspark.engine.batch import length as batch_length
    from mlx_dspark.engine.costs import heal as cost_heal
    from mlx_dspark.engine.costs import probe as cost_probe
    from mlx_dspark.engine.costs.curve import CostCurve

    monkeypatch.setattr(cost_heal, "ENABLED", False)  # nor do their round times correct the synthetic curves

    cache = tmp_path_factory.getbasetemp() / "cost-curves"
    monkeypatch.setenv(cost_probe.COST_DIR_ENV, str(cache))
    measured_dir = cost_probe.cost_cache_dir
    in_process = lambda: measured_dir() / "in-process"  # noqa: E731  (follows a test's own $MLX_DSPARK_COST_DIR)
    monkeypatch.setattr(cost_probe, "cost_cache_dir", in_process)
    monkeypatch.setattr(batch_length, "cost_cache_dir", in_process)
    monkeypatch.setattr(
        cost_probe, "measure_cost_curve", lambda target, draft: CostCurve.flat(max_width=int(getattr(draft, "num_drafts", 7)) + 1, draft_ms=0.0)
    )
    monkeypatch.setattr(cost_probe, "measure_chain_curve", lambda target, drafter, head: CostCurve.flat(max_width=8, draft_ms=0.0))
    # the same for a batching server's packed-forward costs: every forward costs the same, drafts are free
    flat = lambda target, draft, *, max_batch: batch_length.BatchCost(  # noqa: E731
        rows_ms={1: 1.0, 128: 1.0}, sequences_ms={max(max_batch, 2): 1.0}, draft_ms={1: 0.0}, source="flat (tests)")
    monkeypatch.setattr(batch_length, "measure_batch_cost", flat)
