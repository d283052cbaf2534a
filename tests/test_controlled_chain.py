"""The controlled-acceptance benchmark over chained heads (bench/controlled_chain.py; issue 35): an EAGLE-3
draft, a target's own MTP layers and a Gemma 4 assistant run their real chain every round, the round commits exactly the
controlled schedule's acceptance lengths, the output is the target's greedy continuation, and the chain's
own cache stays an uncontrolled run's (each round's real chain equals a fresh chain's over the committed
tokens); the harness reports the chain's cost per step beside the efficiency."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_dspark
from mlx_dspark.engine.proposers.base import Proposer
from mlx_dspark.api import generate
from mlx_dspark.bench.controlled import AcceptanceSchedule, ControlledProposer, format_controlled, greedy_reference, run_controlled
from mlx_dspark.bench.controlled_chain import chain_head, chain_proposer, chain_steps
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.engine.costs import probe as cost_probe
from mlx_dspark.engine.round.decode import prefill
from mlx_dspark.engine.options import GenerationOptions
from mlx_dspark.engine.costs.curve import CostCurve
from mlx_dspark.testing.eagle3_tiny import write_eagle3_draft
from mlx_dspark.testing.gemma4_assistant_tiny import write_assistant
from mlx_dspark.testing.mlx_lm_checkpoints import write_tiny_mlx_lm_target
from mlx_dspark.testing.mtp_tiny import write_tiny_qwen3_5_mtp_target

PROMPT = [1, 5, 9, 20, 33, 7, 100, 250, 3, 64, 17, 42]


@pytest.fixture(scope="module")
def chain_pairs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    root = tmp_path_factory.mktemp("controlled-chain")
    llama = write_tiny_mlx_lm_target(root / "llama", family="llama", seed=0)
    eagle = write_eagle3_draft(root / "eagle3", target_path=llama, seed=5)  # a chain of 3 by default
    mtp = write_tiny_qwen3_5_mtp_target(root / "mtp", seed=0)  # a hybrid target, a chain of 4 by default
    gemma = write_tiny_mlx_lm_target(root / "gemma4", family="gemma4_text", seed=0, sliding_window=16)  # wraps its window
    assistant = write_assistant(root / "assistant", target_path=gemma, seed=1)  # a chain of 3 by default, no cache of its own
    return {"eagle3": (llama, str(eagle)), "mtp": (mtp, "mtp"), "assistant": (gemma, str(assistant))}


class _Recording(Proposer):
    """The chain's proposer, recording each real proposal (position, its drafts) before they are replaced."""

    def __init__(self, inner) -> None:
        self.inner, self.tap_ids, self.block_size = inner, inner.tap_ids, inner.block_size
        self.takes_target_cache = inner.takes_target_cache
        self.proposals: list[tuple[int, list[int]]] = []

    def extend(self, features) -> None:
        self.inner.extend(features)

    def commit(self, tokens) -> None:
        self.inner.commit(tokens)

    def propose(self, anchor, *, position, num_tokens, target_cache=None):
        extra = {} if target_cache is None else {"target_cache": target_cache}
        proposal = self.inner.propose(anchor, position=position, num_tokens=num_tokens, **extra)
        self.proposals.append((position, proposal.tokens[0].tolist()))
        return proposal


def _fresh_chain(loaded, head: str, committed: list[int], *, steps: int, num_tokens: int) -> list[int]:
    """The drafts of a new chain whose cache holds exactly `committed` (the last one the anchor)."""
    fresh = chain_proposer(loaded, head, committed[:-1], steps=steps)
    prefill(loaded.target, loaded.target.make_cache(), committed[:-1], tap_ids=fresh.tap_ids, proposer=fresh)
    fresh.commit(committed[-1:])
    anchor = mx.array(committed[-1:], dtype=mx.int32)
    return fresh.propose(anchor, position=len(committed) - 1, num_tokens=num_tokens).tokens[0].tolist()


@pytest.mark.parametrize("head, acceptance", [("eagle3", 4.5), ("mtp", 3.0), ("assistant", 4.5)])
def test_controlled_chain_commits_the_schedule_and_keeps_the_chain_cache(chain_pairs, head, acceptance):
    target_dir, draft = chain_pairs[head]
    loaded = mlx_dspark.load(str(target_dir), draft=draft)
    assert chain_head(loaded) == head
    steps = chain_steps(loaded, head, [acceptance])
    assert steps == 4  # eagle3, the assistant: their 3 raised so that 4.5 fits; mtp: its default 4
    model = prepare_model(loaded, RunSettings(ignore_eos=True))
    max_tokens = 1 + int(acceptance * 10)  # the prefill's token, then about 10 rounds
    reference = greedy_reference(loaded.target, PROMPT, max_tokens + steps + 1)
    recorder = _Recording(chain_proposer(loaded, head, PROMPT, steps=steps))
    proposer = ControlledProposer(recorder, reference, prompt_len=len(PROMPT), vocab_size=loaded.target.args.vocab_size,
                                  acceptance_length=acceptance)  # fmt: skip
    options = GenerationOptions.from_keywords(max_tokens=max_tokens, max_draft_tokens=None, lookup="off")  # as run_controlled
    result = generate(model, PROMPT, options=options, proposer=proposer)

    expected = AcceptanceSchedule(acceptance, block_size=steps)
    full_rounds = result.acceptance_lengths[:-1]  # the last round may be cut by max_tokens
    assert len(full_rounds) >= 8 and full_rounds == [expected.next() for _ in full_rounds]
    assert result.tokens == reference[:max_tokens]  # the corrupted drafts were rejected, nothing else
    assert len(recorder.proposals) == result.rounds  # the real chain ran every round
    if head == "assistant":  # it keeps no cache of its own: it reads the target's (passed on, or it would raise)
        return
    committed = PROMPT + result.tokens
    for position, drafts in recorder.proposals:
        assert drafts == _fresh_chain(loaded, head, committed[: position + 1], steps=steps, num_tokens=len(drafts)), position


def test_controlled_run_of_a_chain_reports_its_cost_per_step(chain_pairs):
    target_dir, draft = chain_pairs["eagle3"]
    model = prepare_model(mlx_dspark.load(str(target_dir), draft=draft), RunSettings(ignore_eos=True))
    result = run_controlled(model, [PROMPT * 2], acceptance_lengths=[2.0, 5.0], max_tokens=12, repeats=1, probe_samples=1)
    assert result["head"] == "eagle3" and result["draft_tokens"] == 4  # a chain of 4 for acceptance 5
    assert result["draft_step_ms"] >= 0 and result["draft_first_ms"] > 0
    assert [row["outputs_match_reference"] for row in result["rows"]] == [1.0, 1.0]
    assert "eagle3 chain of 4" in format_controlled(result) and "per chained step" in format_controlled(result)


def test_the_benchmark_command_measures_a_chained_heads_curve_and_efficiency(chain_pairs, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from mlx_dspark.cli.benchmark import app

    def chain_curve(target, drafter, *, head, context, repeats, seed, chain):  # no timing in tests: a flat curve
        assert head == "mtp" and chain == 5
        return dataclasses.replace(CostCurve.flat(max_width=8, draft_ms=1.0), draft_step_ms=0.5, context=context)

    monkeypatch.setattr(cost_probe, "measure_chain_curve", chain_curve)

    target_dir, _ = chain_pairs["mtp"]
    out = tmp_path / "out"
    args = ["--model", str(target_dir), "--draft", "mtp", "--skip-datasets", "--out", str(out), "--no-progress", "--no-mlx-lm-baseline",
            "--controlled-acceptance", "6", "--controlled-context", "12", "--controlled-prompts", "1", "--controlled-tokens", "8",
            "--repeats", "1", "--cost-repeats", "1"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    curve, controlled = results["cost_curve"], results["controlled"]
    assert curve["head"] == "mtp" and curve["chain_steps"] == 5 and len(curve["verify_ms"]) == 8  # 4 raised so that 6 fits
    assert (curve["draft_ms"], curve["draft_step_ms"], curve["draft_block_ms"]) == (1.0, 0.5, 3.5)
    assert controlled["head"] == "mtp" and controlled["draft_tokens"] == 5 and controlled["rows"][0]["outputs_match_reference"] == 1.0
    assert "mtp chain of 5" in result.output and "per chained step" in result.output


def test_the_benchmarks_dataset_rows_run_with_a_chained_head(chain_pairs, tmp_path, monkeypatch):
    """`benchmark` with `--draft mtp` and no draft model: the dataset rows run (they refused: 'needs a draft'),
    each row's acceptance over the chain's length, the outputs plain decoding's."""
    from typer.testing import CliRunner

    from mlx_dspark.cli.benchmark import app

    monkeypatch.setattr(cost_probe, "measure_chain_curve", lambda target, drafter, **kw:  # no timing in tests
                        dataclasses.replace(CostCurve.flat(max_width=8, draft_ms=1.0), draft_step_ms=0.5, context=kw.get("context", 32)))
    target_dir, _ = chain_pairs["mtp"]
    out = tmp_path / "out"
    args = ["--model", str(target_dir), "--draft", "mtp", "--datasets", "gsm8k", "--prompts-per-dataset", "1", "--max-tokens", "6",
            "--no-mlx-lm-baseline", "--no-progress", "--out", str(out), "--repeats", "1", "--cost-repeats", "1"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["rows"] and "token-identical to the baseline: 1/1 prompts" in result.output
