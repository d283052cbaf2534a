"""What the MTP family tests share (tests/test_mtp_qwen3_next.py, test_mtp_nemotron_h.py): the target's final
normed states, the tolerance against a float64 restatement, and the checks every family makes the same way
(a chain against the restatement's, greedy speculation against mlx-lm's generate, a conversion loading the
same layers, a sampled chi-square on an 8-token checkpoint loaded through the real path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

import mlx_dspark
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.engine.proposers.mtp import MTPProposer
from mlx_dspark.engine.options import SpeculationOptions
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.loading.checkpoint import read_checkpoint
from mlx_dspark.loading.load import build_target
from mlx_dspark.loading.heads.mtp import build_mtp
from mlx_dspark.models.layers.base import FINAL_TAP
from mlx_dspark.models.target.mlx_lm import probe_target
from tests.engine_helpers import assert_chain_sampling_is_exact
from tests.test_mtp import mlx_lm_greedy

PROMPT = [1, 5, 9, 20, 33, 7, 100, 250, 3, 64, 17, 42]
FIXED = SpeculationOptions(max_draft_tokens=3)
CHI_PROMPT = [1, 5, 2, 7, 3]  # test_lossless_sampling's PROMPT, which exact_distribution reads
CHI_SAMPLER = Sampler(temperature=0.7)


def final_hidden(target: Any, tokens: list[int]) -> mx.array:
    _, features = target(mx.array([tokens]), tap_ids=(FINAL_TAP,))
    return features  # (1, n, C)


def close(ours: np.ndarray, expected: np.ndarray) -> bool:
    return float(np.abs(ours - expected).max()) < 1e-4 * max(1.0, float(np.abs(expected).max()))


def greedy_chain_of(loaded: Any, *, anchor: int = 77, steps: int = 4) -> tuple[Any, MTPProposer]:
    """A greedy proposal of `steps` chained drafts after PROMPT and `anchor`, and the proposer it left."""
    proposer = MTPProposer(loaded.heads["mtp"], loaded.target, prompt=PROMPT, greedy=True, temperature=1.0, block_size=steps)
    proposer.extend(final_hidden(loaded.target, PROMPT))
    proposer.commit([anchor])
    return proposer.propose(mx.array([anchor]), position=len(PROMPT), num_tokens=steps), proposer


def assert_greedy_speculation_is_mlx_lms_generate(target_dir: Path, loaded: Any, max_tokens: int = 210) -> None:
    reference = mlx_lm_greedy(target_dir, PROMPT, max_tokens)
    spec = mlx_dspark.generate(prepare_model(loaded, RunSettings(ignore_eos=True)), PROMPT, max_tokens=max_tokens, max_draft_tokens=3)
    assert spec.tokens == reference and len(reference) == max_tokens
    assert spec.rounds < max_tokens and spec.acceptance_lengths


def assert_conversion_loads_the_same_layers(loaded: Any, out: Path) -> Any:
    converted = mlx_dspark.load(str(out), draft="mtp")
    ours, theirs = dict(tree_flatten(loaded.heads["mtp"].parameters())), dict(tree_flatten(converted.heads["mtp"].parameters()))
    assert ours.keys() == theirs.keys() and all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
    return converted


def assert_sampled_speculation_is_exact(write: Callable[..., Path], tmp_path: Path) -> None:
    """An 8-token target written by `write(path, seed=, vocab_size=)` and its MTP layers, through the real loading."""
    checkpoint = read_checkpoint(write(tmp_path / "chi", seed=5, vocab_size=8))
    target, mtp = build_target(checkpoint), build_mtp(checkpoint)
    target.eval()
    mx.eval(target.parameters(), mtp.parameters())
    probe_target(target)
    make = lambda: MTPProposer(mtp, target, prompt=CHI_PROMPT, greedy=False, temperature=CHI_SAMPLER.temperature)  # noqa: E731
    assert_chain_sampling_is_exact(target, make, sampler=CHI_SAMPLER, speculation=FIXED, runs=300, seed=11)
