"""The benchmark: prompt files, acceptance statistics, the controlled proposer, and an end-to-end run
on the tiny pairs whose JSON must carry every field (no speed is asserted anywhere)."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

import mlx_dspark
from mlx_dspark.api import generate
from mlx_dspark.bench.builtin_prompts import BUILTIN
from mlx_dspark.bench.controlled import AcceptanceSchedule, ControlledProposer, greedy_reference
from mlx_dspark.bench.lossless import first_difference
from mlx_dspark.bench.prompts import builtin_prompts, load_jsonl, parse_dataset_option, select_prompts
from mlx_dspark.bench.runner import RunSettings, prepare_model
from mlx_dspark.bench.stats import acceptance_histogram, position_acceptance
from mlx_dspark.cli.benchmark import app
from mlx_dspark.engine.proposers.dspark import DraftProposer

MODEL_CARD_ROWS = ["AIME25", "GSM8K", "MATH500", "HumanEval", "MBPP", "Arena-Hard-v2"]


# -- prompts ---------------------------------------------------------------------------------------


def test_builtin_sets_are_the_model_card_rows_with_a_handful_of_prompts_each():
    assert [display for display, _ in BUILTIN.values()] == MODEL_CARD_ROWS
    for name in BUILTIN:
        prompts = builtin_prompts(name)
        assert len(prompts) >= 4
        assert all(p.messages[-1]["role"] == "user" and p.text.strip() for p in prompts)
    assert len(builtin_prompts("gsm8k", limit=2)) == 2


def test_unknown_builtin_set_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown built-in dataset 'gsm9k'"):
        select_prompts(datasets=["gsm9k"], files=[], limit=None)


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_accepts_every_layout(tmp_path):
    lines = [
        json.dumps({"prompt": "p text"}),
        json.dumps({"question": "q text", "answer": "42"}),
        json.dumps({"problem": "r text", "solution": "..."}),
        json.dumps({"turns": ["first turn", "second turn"]}),
        json.dumps({"turns": [{"content": "arena turn"}]}),
        "",
        json.dumps({"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ref"}]}),
    ]
    prompts = load_jsonl("mine", _write_jsonl(tmp_path / "set.jsonl", lines))
    assert [p.text for p in prompts] == ["p text", "q text", "r text", "first turn", "arena turn", "hi"]
    assert prompts[-1].messages == ({"role": "system", "content": "sys"}, {"role": "user", "content": "hi"})
    assert {p.category for p in prompts} == {"mine"}
    assert [p.index for p in prompts] == list(range(6))


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", r"set.jsonl:2: not valid JSON"),
        (json.dumps({"text": "x"}), r"set.jsonl:2: no prompt field; expected one of \['prompt', 'question'"),
        (json.dumps({"prompt": ""}), r"set.jsonl:2: field 'prompt' must be a non-empty string"),
        (json.dumps({"turns": []}), r"set.jsonl:2: field 'turns' must be a non-empty list"),
        (json.dumps({"messages": [{"role": "user"}]}), r"set.jsonl:2: messages\[0\] must be an object"),
        (json.dumps({"messages": [{"role": "assistant", "content": "a"}]}), r"set.jsonl:2: 'messages' must end with a user message"),
        (json.dumps(["a list"]), r"set.jsonl:2: expected a JSON object"),
    ],
)
def test_malformed_jsonl_line_is_an_error_with_its_line_number(tmp_path, bad_line, message):
    path = _write_jsonl(tmp_path / "set.jsonl", [json.dumps({"prompt": "fine"}), bad_line])
    with pytest.raises(ValueError, match=message):
        load_jsonl("mine", path)


def test_dataset_option_needs_name_and_file(tmp_path):
    assert parse_dataset_option("gsm8k=/data/g.jsonl")[0] == "gsm8k"
    with pytest.raises(ValueError, match="NAME=FILE.jsonl"):
        parse_dataset_option("just-a-file.jsonl")
    with pytest.raises(ValueError, match="no such file"):
        load_jsonl("x", tmp_path / "missing.jsonl")


# -- statistics ------------------------------------------------------------------------------------


def test_acceptance_histogram_and_per_position_rates():
    lengths = [1, 3, 8, 2]  # accepted 0, 2, 7, 1
    proposals = [7, 7, 7, 1]  # the last round verified a single draft token
    assert acceptance_histogram(lengths, block_size=7) == [1, 1, 1, 0, 0, 0, 0, 1]
    rows = position_acceptance(lengths, proposals, block_size=7)
    assert rows[0] == {"position": 1, "reached": 4, "accepted": 3, "rate": 0.75}
    assert rows[1] == {"position": 2, "reached": 2, "accepted": 2, "rate": 1.0}
    assert rows[2] == {"position": 3, "reached": 2, "accepted": 1, "rate": 0.5}
    assert rows[6] == {"position": 7, "reached": 1, "accepted": 1, "rate": 1.0}
    with pytest.raises(ValueError, match="outside 1..8"):
        acceptance_histogram([9], block_size=7)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


# -- controlled acceptance -------------------------------------------------------------------------


@pytest.mark.parametrize("target", [3.0, 4.0, 4.55, 6.0])
def test_acceptance_schedule_mean_tracks_the_target(target):
    schedule = AcceptanceSchedule(target, block_size=7)
    lengths = [schedule.next() for _ in range(20)]
    assert all(1 <= n <= 8 for n in lengths)
    assert abs(sum(lengths) / len(lengths) - target) <= 0.5 / 20


def test_acceptance_schedule_rejects_impossible_targets():
    with pytest.raises(ValueError, match="must be in \\[1, 8\\]"):
        AcceptanceSchedule(8.5, block_size=7)


class _CountingDraft(DraftProposer):
    calls = 0

    def propose(self, anchor, *, position, num_tokens):
        type(self).calls += 1
        return super().propose(anchor, position=position, num_tokens=num_tokens)


@pytest.mark.parametrize("target", [3.0, 4.55, 6.0])
def test_controlled_proposer_hits_its_acceptance_on_the_tiny_pair(tiny_spark_pair, target):
    loaded = mlx_dspark.load(*tiny_spark_pair)
    model = prepare_model(loaded, RunSettings(ignore_eos=True))
    prompt = list(range(40, 70))
    rounds = 20
    max_tokens = 1 + int(target * rounds)  # the prefill's token, then about `rounds` full rounds
    reference = greedy_reference(loaded.target, prompt, max_tokens + 8)
    _CountingDraft.calls = 0
    inner = _CountingDraft(loaded.draft, loaded.target, greedy=True, temperature=1.0)
    proposer = ControlledProposer(inner, reference, prompt_len=len(prompt), vocab_size=loaded.target.args.vocab_size, acceptance_length=target)
    result = generate(model, prompt, max_tokens=max_tokens, proposer=proposer)

    expected = AcceptanceSchedule(target, block_size=7)
    full_rounds = result.acceptance_lengths[:-1]  # the last round may be cut by max_tokens
    assert full_rounds == [expected.next() for _ in full_rounds]
    assert abs(sum(full_rounds) / len(full_rounds) - target) < 0.05
    assert result.tokens == reference[:max_tokens]  # the corrupted drafts were rejected, nothing else
    assert _CountingDraft.calls == result.rounds  # the real draft ran every round


# -- end to end ------------------------------------------------------------------------------------

PROMPT_FIELDS = {"category", "index", "prompt_tokens", "baseline", "dspark", "mlx_lm", "best_baseline_tps", "speedup", "speedup_vs_our_baseline", "lossless"}
SPEED_FIELDS = {"generation_tps", "time_to_first_token", "total_time", "peak_memory_gb", "generated_tokens", "generation_tps_runs"}
DSPARK_FIELDS = SPEED_FIELDS | {"mean_acceptance_length", "rounds", "acceptance_histogram", "position_acceptance", "target_forwards_per_token"}
ROW_FIELDS = {"dataset", "prompts", "tps_without", "tps_with", "speedup", "mean_acceptance_length", "our_baseline_tps", "mlx_lm_baseline_tps", "greedy_identical"}
CURVE_FIELDS = {"context", "verify_ms", "verify_build_ms", "verify_ratio", "decode_step_ms", "plain_loop_ms", "draft_block_ms", "draft_layers_ms", "draft_layers_and_lm_head_ms", "markov_and_sampling_ms", "break_even_acceptance", "loadavg"}
CONTROLLED_ROW_FIELDS = {"target_acceptance_length", "measured_acceptance_length", "tokens_per_second", "measured_speedup", "ideal_speedup", "efficiency", "round_ms", "ideal_round_ms", "outputs_match_reference"}


@pytest.mark.parametrize("pair_name, mlx_lm_kind", [("tiny_spark_pair", "mlx_lm.load"), ("tiny_qwen3_pair", "mlx_lm.load")])
def test_benchmark_runs_end_to_end_and_its_json_has_every_field(request, tmp_path, pair_name, mlx_lm_kind):
    target, draft = request.getfixturevalue(pair_name)
    jsonl = _write_jsonl(tmp_path / "extra.jsonl", [json.dumps({"question": "What is 2 + 2?"})])
    out = tmp_path / "out"
    args = ["--model", str(target), "--draft", str(draft), "--datasets", "gsm8k", "--dataset", f"Extra={jsonl}"]
    args += ["--prompts-per-dataset", "1", "--max-tokens", "5", "--ignore-eos", "--out", str(out), "--no-progress", "--parity-repeats", "2"]
    args += ["--cost-curve", "--cost-repeats", "1", "--controlled-acceptance", "4.55", "--controlled-context", "12", "--controlled-prompts", "1", "--controlled-tokens", "10"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output

    results = json.loads((out / "results.json").read_text())
    assert [r["dataset"] for r in results["rows"]] == ["GSM8K", "Extra"]
    assert set(results["average"]) == ROW_FIELDS and results["average"]["dataset"] == "Average"
    for row in results["rows"]:
        assert set(row) == ROW_FIELDS
        assert row["greedy_identical"] == 1.0  # default BLAS: greedy speculative output is the baseline's
    assert len(results["prompts"]) == 2
    for record in results["prompts"]:
        assert set(record) == PROMPT_FIELDS
        assert set(record["baseline"]) == SPEED_FIELDS
        assert set(record["dspark"]) == DSPARK_FIELDS
        assert set(record["mlx_lm"]) == SPEED_FIELDS | {"tokens_match_baseline"}
        assert record["mlx_lm"]["tokens_match_baseline"] is True
        assert record["baseline"]["generated_tokens"] == record["dspark"]["generated_tokens"] == 5
        assert sum(record["dspark"]["acceptance_histogram"]) == record["dspark"]["rounds"]
        assert len(record["dspark"]["position_acceptance"]) == 7
        assert record["lossless"] == {"identical": True, "first_difference": None, "top2_margin": None}
    parity = results["baseline_parity"]
    assert len(parity["our_tps_runs"]) == len(parity["mlx_lm_tps_runs"]) == 2 and parity["mlx_lm_kind"] == mlx_lm_kind
    assert set(parity) >= {"our_tps", "mlx_lm_tps", "ours_over_mlx_lm"}
    meta = results["meta"]
    assert meta["mlx_lm_baseline"] == mlx_lm_kind
    assert {"command", "machine", "mlx", "mlx_lm", "blas", "loadavg_start", "loadavg_end", "settings"} <= set(meta)
    assert set(results["cost_curve"]) >= CURVE_FIELDS and set(results["cost_curve"]["verify_ms"]) == {str(w) for w in range(1, 9)}
    assert json.loads((out / "cost_curve.json").read_text())["context"] == results["cost_curve"]["context"]
    controlled = results["controlled"]
    assert "not model acceptance" in controlled["label"]
    assert [set(row) >= CONTROLLED_ROW_FIELDS for row in controlled["rows"]] == [True]
    assert controlled["rows"][0]["outputs_match_reference"] == 1.0
    assert {"round_ms", "draft_graph_build_ms", "verify_graph_build_ms", "context_append_build_ms", "other_ms"} <= set(controlled["profile"])
    md = (out / "results.md").read_text()
    assert "| Average |" in md and "ENGINE MEASUREMENT" in md
    assert "GSM8K" in result.output


def test_benchmark_cli_reports_a_bad_dataset_line(tiny_spark_pair, tmp_path):
    target, draft = tiny_spark_pair
    bad = _write_jsonl(tmp_path / "bad.jsonl", ["{oops"])
    result = CliRunner().invoke(app, ["--model", str(target), "--draft", str(draft), "--dataset", f"Bad={bad}", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "bad.jsonl:1: not valid JSON" in result.output


def test_benchmark_needs_the_draft_of_a_given_model(tiny_spark_pair, tmp_path):
    result = CliRunner().invoke(app, ["--model", str(tiny_spark_pair[0]), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "--draft: the DSpark draft of --model is required" in result.output


def test_openblas_flag_refuses_to_run_in_process_without_the_preload(tiny_spark_pair, tmp_path):
    # Inside another program (here pytest) the flag cannot re-execute the process: it must refuse
    # rather than silently benchmark with the bundled BLAS. (Tests never preload OpenBLAS.)
    target, draft = tiny_spark_pair
    result = CliRunner().invoke(app, ["--openblas", "--model", str(target), "--draft", str(draft), "--out", str(tmp_path)])
    if sys.platform == "linux" and "libopenblas" in open("/proc/self/maps").read():
        pytest.skip("this test process already has OpenBLAS loaded")
    assert result.exit_code == 2
    expected = ("before mlx is imported", "libopenblas.so.0 not found") if sys.platform == "linux" else ("Linux CPU runs only",)
    assert any(text in result.output for text in expected)


def test_existing_results_are_not_overwritten_without_force(tiny_spark_pair, tmp_path):
    target, draft = tiny_spark_pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('{"mine": true}')
    args = ["--model", str(target), "--draft", str(draft), "--datasets", "gsm8k", "--prompts-per-dataset", "1"]
    args += ["--max-tokens", "3", "--no-mlx-lm-baseline", "--no-progress", "--out", str(out)]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code != 0 and "--force" in refused.stderr
    assert json.loads((out / "results.json").read_text()) == {"mine": True}
    forced = CliRunner().invoke(app, args + ["--force"])
    assert forced.exit_code == 0, forced.output
    assert "rows" in json.loads((out / "results.json").read_text())


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--seed", "-1"], "--seed: seed must be an integer in [0, 2**64 - 1]"),
        (["--temperature", "-1"], "--temp: temperature must be a finite number >= 0"),
        (["--max-tokens", "1"], "max_tokens must be >= 2"),
        (["--spec-draft-n-max", "8"], "--max-draft-tokens: max_draft_tokens must be at most the draft's block size 7, got 8"),
    ],
)
def test_benchmark_cli_refuses_bad_generation_flags_with_one_line(tiny_spark_pair, tmp_path, extra, message):
    target, draft = tiny_spark_pair
    args = ["--model", str(target), "--draft", str(draft), "--datasets", "gsm8k", "--prompts-per-dataset", "1"]
    args += ["--no-mlx-lm-baseline", "--no-progress", "--out", str(tmp_path / "out"), *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr
    assert not (tmp_path / "out" / "results.json").exists()


def test_run_settings_give_each_run_its_mode_and_seed_over_the_shared_options():
    from mlx_dspark.engine.options import GenerationOptions, SamplingOptions, SpeculationOptions

    generation = GenerationOptions(
        max_tokens=32, sampling=SamplingOptions(temperature=0.7, seed=3), speculation=SpeculationOptions(max_draft_tokens=4)
    )
    settings = RunSettings(generation=generation, repeats=2)
    run = settings.options(speculative=False, seed=settings.seed + 1, max_tokens=5)
    assert run.max_tokens == 5 and run.sampling.seed == 4 and run.sampling.temperature == 0.7
    assert run.speculation == SpeculationOptions(speculative=False, max_draft_tokens=4)
    assert settings.options(speculative=True, seed=3).max_tokens == 32


@pytest.mark.parametrize("pair_name, columns", [("tiny_spark_pair", 4), ("tiny_qwen3_pair", 3)])
def test_card_columns_run_both_schedules_through_the_template_switches(request, tmp_path, pair_name, columns):
    from mlx_dspark.api import encode_prompt
    from mlx_dspark.bench.card import THINKING_SWITCHES
    from mlx_dspark.engine.costs.curve import CostCurve

    target, draft = request.getfixturevalue(pair_name)
    loaded = mlx_dspark.load(str(target), draft=str(draft))
    switches = THINKING_SWITCHES[loaded.target_config["model_type"]]
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    with_thinking = encode_prompt(loaded.tokenizer, messages, chat_template_kwargs=switches["high"])
    assert with_thinking != encode_prompt(loaded.tokenizer, messages, chat_template_kwargs=switches["none"])

    curve_file = tmp_path / "flat.json"
    curve_file.write_text(json.dumps(CostCurve.flat(max_width=8).to_json()))
    out = tmp_path / "out"
    args = ["--model", str(target), "--draft", str(draft), "--datasets", "gsm8k", "--prompts-per-dataset", "1", "--skip-datasets"]
    args += ["--ignore-eos", "--card-columns", "--card-max-tokens", "8", "--cost-curve-file", str(curve_file), "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    card = json.loads((out / "results.json").read_text())["card_columns"]
    assert card["max_tokens"] == 8 and card["cost_curve"]["source"] == str(curve_file)
    assert len(card["columns"]) == columns
    for column in card["columns"]:
        assert {"column", "template_kwargs", "card_acceptance_length", "fixed", "confidence", "confidence_over_fixed_tps"} <= set(column)
        assert column["fixed"]["generated_tokens"] == column["confidence"]["generated_tokens"] == 8
        for schedule in ("fixed", "confidence"):  # rounded as every other report's (issue 33.6)
            mean = column[schedule]["mean_acceptance_length"]
            assert mean == round(mean, 3) and 1 <= mean <= 8
    greedy = card["columns"][-1]
    assert greedy["column"].startswith("T=0")
    # flat curve: the confidence schedule verifies every draft the fixed one does
    assert greedy["fixed"]["mean_verified_drafts"] == greedy["confidence"]["mean_verified_drafts"]
    assert "Model-card acceptance columns" in result.output


def test_schedule_ab_runs_on_the_tiny_pair_and_flat_curve_matches_fixed(tiny_spark_pair, tmp_path):
    from mlx_dspark.engine.costs.curve import CostCurve

    target, draft = tiny_spark_pair
    curve_file = tmp_path / "steep.json"
    curve_file.write_text(json.dumps(CostCurve(draft_ms=0.4, verify_ms=tuple(1 + 0.3 * n for n in range(8))).to_json()))
    out = tmp_path / "out"
    args = ["--model", str(target), "--draft", str(draft), "--skip-datasets", "--datasets", "gsm8k", "--schedule-ab"]
    args += ["--controlled-context", "12", "--controlled-prompts", "1", "--controlled-tokens", "30", "--cost-curve-file", str(curve_file)]
    result = CliRunner().invoke(app, [*args, "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    ab = json.loads((out / "results.json").read_text())["schedule_ab"]
    rows = {row["mode"]: row for row in ab["rows"]}
    assert set(rows) == {"fixed", "confidence (machine curve)", "confidence (flat curve)"}
    assert all(row["outputs_match_reference"] == 1.0 for row in rows.values())
    # same random stream: a flat curve verifies what fixed does; the steep one verifies less in hard rounds
    assert rows["confidence (flat curve)"]["mean_verified_drafts"] == rows["fixed"]["mean_verified_drafts"]
    assert rows["confidence (machine curve)"]["mean_verified_drafts"] < rows["fixed"]["mean_verified_drafts"]
    assert ab["ideal_confidence_over_fixed"]["flat"] == 1.0 and ab["ideal_confidence_over_fixed"]["machine"] > 1.0


def test_a_lookup_round_longer_than_the_draft_block_gets_its_histogram_bin():
    from mlx_dspark.bench.runner import _acceptance_summary
    from mlx_dspark.engine.round.results import GenerationResult

    run = GenerationResult(text="", tokens=list(range(40)), finish_reason="length", prompt_tokens=3, prompt_tps=1.0,
                           generation_tps=1.0, peak_memory_gb=0.0, acceptance_lengths=[23, 1, 4, 8],
                           proposal_lengths=[22, 0, 7, 7])  # a 22-token lookup block, a parked round, two draft blocks
    summary = _acceptance_summary([run], block_size=7)
    assert summary["acceptance_histogram"] == [1, 0, 0, 1, 0, 0, 0, 1] + [0] * 14 + [1]
    assert len(summary["position_acceptance"]) == 7  # the draft's positions
    assert summary["mean_acceptance_length"] == 9.0


def test_the_top2_margin_runs_on_a_split_targets_rank_0(tiny_qwen3_pair):
    # a split target's rank 0 (LeaderTarget) announces every forward with its cache to the other ranks and
    # refuses one without: the margin of a differing greedy prompt ran cache-less and ended the benchmark
    import mlx.core as mx

    from mlx_dspark.bench.lossless import top2_margin
    from mlx_dspark.loading.load import load
    from mlx_dspark.models.distributed.split_target import lead

    target = load(str(tiny_qwen3_pair[0])).target
    prompt, prefix = [5, 9, 2, 7], [3, 3]
    logits, _ = target(mx.array([prompt + prefix], dtype=mx.int32))
    top2 = mx.topk(logits[0, -1].astype(mx.float32), 2)
    expected = float((top2[1] - top2[0]).item())
    lead(target, mx.distributed.init())  # a group of one here: the announcements are identities
    assert top2_margin(target, prompt, prefix) == pytest.approx(expected, rel=1e-5, abs=1e-5)
