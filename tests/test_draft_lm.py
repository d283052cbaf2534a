"""A small causal LM as the draft (`--draft` / `--draft-model` PATH: models/heads/draft_lm, the "lm" head), on
tiny random checkpoints in the Hugging Face layout sharing the target's tokenizer: lossless greedy and sampled,
equal to mlx-lm's own speculative decoding on a plain-KV pair, over hybrid (GatedDeltaNet) and sliding-window
targets and drafts mlx-lm refuses, batched, resumed from a prompt cache, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mlx_dspark
from mlx_dspark.engine.costs import probe as cost_probe
from mlx_dspark.engine.costs.probe import measure_chain_curve, measure_cost_curve
from mlx_dspark.engine.options import GenerationOptions, SamplingOptions, SpeculationOptions
from mlx_dspark.engine.proposers.draft_lm import LMProposer
from mlx_dspark.loading.heads import detect_head
from mlx_dspark.models.heads.draft_lm import DraftLM
from mlx_dspark.testing.mlx_lm_checkpoints import read_config, tiny_mlx_lm_config, write_draft_for, write_tiny_mlx_lm_target

PROMPT = [5, 17, 33, 9, 100, 3, 44, 250, 12]
FAMILIES = {  # the target's and the draft's caches: full KV, GatedDeltaNet + KV, rotating windows past their size
    "llama": {},
    "qwen3_5": {},
    "gemma3_text": {"sliding_window": 6},
}


def perturbed_copy(source: Path, path: Path, *, scale: float = 0.5, seed: int = 3) -> Path:
    """A copy of `source` with noise in its last MLP's down projection: a draft that accepts partly."""
    shutil.copytree(source, path)
    file = next(path.glob("*.safetensors"))
    weights = load_file(str(file))
    name = sorted(k for k in weights if k.endswith("down_proj.weight"))[-1]
    rng = np.random.default_rng(seed)
    weights[name] = weights[name] + scale * weights[name].std() * rng.standard_normal(weights[name].shape).astype(np.float32)
    save_file(weights, str(file), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Per family: the target's directory, a draft that is its copy (accepts fully) and a perturbed one (partly)."""
    root = tmp_path_factory.mktemp("draft_lm")
    out = {}
    for family, overrides in FAMILIES.items():
        target = write_tiny_mlx_lm_target(root / family / "target", family=family, seed=0, **overrides)
        full = write_tiny_mlx_lm_target(root / family / "full", family=family, seed=0, **overrides)
        out[family] = (target, full, perturbed_copy(full, root / family / "partly"))
    return out


def plain(model, prompt, n):
    return mlx_dspark.generate(model, prompt, max_tokens=n, speculative=False).tokens


def mlx_lms_speculative(target: Path, draft: Path, prompt: list[int], n: int, k: int = 2) -> list[int]:
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(target)
    draft_model, _ = load_model(draft)
    steps = speculative_generate_step(mx.array(prompt), model, draft_model, num_draft_tokens=k, max_tokens=n)
    return [int(token) for token, _, _ in steps]


# -- greedy: plain decoding, mlx-lm's own speculative decoding ------------------------------------------------


@pytest.mark.parametrize("draft", ["full", "partly"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_draft_model_speculation_is_plain_decoding_and_mlx_lms(pairs, family, draft):
    """Fixed lengths 2 (mlx-lm's default) and 5 and the auto length: the output is plain decoding's, and on the
    plain-KV pair mlx-lm's `speculative_generate_step` on the same files; the hybrid's recurrent state (mlx-lm
    refuses it) and the wrapped sliding windows' rotating buffers roll back exactly."""
    target, full, partly = pairs[family]
    path = full if draft == "full" else partly
    model = mlx_dspark.load(str(target), draft=str(path))
    assert list(model.heads) == ["lm"] and isinstance(model.heads["lm"], DraftLM)
    n = 40
    reference = plain(model, PROMPT, n)
    results = [mlx_dspark.generate(model, PROMPT, max_tokens=n, max_draft_tokens=k, lookup="off") for k in (2, 5, "auto")]
    for result in results:
        assert result.tokens == reference
    proposed, accepted = sum(results[1].proposal_lengths), sum(a - 1 for a in results[1].acceptance_lengths)
    if draft == "full":
        assert accepted == proposed > 0
    else:
        assert 0 < accepted < proposed
    if family == "llama":
        assert mlx_lms_speculative(target, path, PROMPT, n) == reference
    elif family == "qwen3_5":
        with pytest.raises(ValueError, match="trimmable"):
            mlx_lms_speculative(target, path, PROMPT, n)


def test_a_small_hybrid_draft_beside_a_plain_target_and_a_padded_table(tmp_path, pairs):
    """A qwen3_5 (GatedDeltaNet) draft of the llama target's tokenizer, and a draft whose table is wider than
    the target's (ids past the target's vocabulary cut): random drafts, the output is plain decoding's."""
    target = pairs["llama"][0]
    hybrid = write_tiny_mlx_lm_target(tmp_path / "hybrid", family="qwen3_5", seed=4)
    padded = write_tiny_mlx_lm_target(tmp_path / "padded", family="llama", seed=5, vocab_size=400)
    for draft in (hybrid, padded):
        model = mlx_dspark.load(str(target), draft=str(draft))
        assert mlx_dspark.generate(model, PROMPT, max_tokens=24, max_draft_tokens=3).tokens == plain(model, PROMPT, 24)


def test_a_quantized_draft_model_is_lossless(pairs):
    target, _, partly = pairs["llama"]
    model = mlx_dspark.load(str(target), draft=str(partly), draft_quantize=8)
    assert "scales" in str(list(dict(model.heads["lm"].parameters()["model"]["model"]["layers"][0]["mlp"]["down_proj"])))
    result = mlx_dspark.generate(model, PROMPT, max_tokens=30, max_draft_tokens=4)
    assert result.tokens == plain(model, PROMPT, 30) and sum(result.proposal_lengths) > 0


def test_the_draft_model_and_a_dspark_draft_are_chosen_per_round_and_stay_lossless(pairs, tmp_path):
    target, _, partly = pairs["llama"]
    dspark = write_draft_for(tmp_path / "dspark", target_path=target, seed=1)
    model = mlx_dspark.load(str(target), draft=f"{dspark},{partly}")
    assert list(model.heads) == ["draft", "lm"]
    assert mlx_dspark.generate(model, PROMPT, max_tokens=30).tokens == plain(model, PROMPT, 30)


# -- sampled: the target's exact distribution -----------------------------------------------------------------


def test_sampled_draft_model_speculation_matches_the_exact_target_distribution():
    """An 8-token llama target and a llama draft of other random weights (embeddings large so the context
    matters): 3 sampled tokens, chi-square against the target's exact joint distribution."""
    from mlx.utils import tree_flatten, tree_unflatten

    from mlx_dspark.models.target import mlx_lm as mlx_lm_target
    from mlx_dspark.testing.mlx_lm_checkpoints import _random
    from tests.engine_helpers import assert_chain_sampling_is_exact
    from tests.test_lossless_sampling import PROMPT as CHI_PROMPT
    from tests.test_mtp import CHI_SAMPLER, FIXED

    sizes = dict(vocab_size=8, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, num_hidden_layers=2)  # fmt: skip
    config = tiny_mlx_lm_config("llama", {"bos": 1, "eos": 2, "pad": 0}, **sizes)

    def randomized(model, seed):
        rng = np.random.default_rng(seed)
        model.update(tree_unflatten([(n, mx.array(_random(rng, n, tuple(p.shape)) * (30.0 if "embed" in n else 1.0)))
                                     for n, p in tree_flatten(model.parameters())]))  # fmt: skip
        mx.eval(model.parameters())
        return model

    target = randomized(mlx_lm_target.from_config(config), 5)
    mlx_lm_target.probe_target(target)
    model_class, args_class = mlx_lm_target.mlx_lm_classes(config)
    draft = DraftLM(randomized(model_class(args_class.from_dict(config)), 6), vocab_size=8, model_type="llama")
    make = lambda: LMProposer(draft, prompt=CHI_PROMPT, greedy=False, temperature=CHI_SAMPLER.temperature)  # noqa: E731
    assert_chain_sampling_is_exact(target, make, sampler=CHI_SAMPLER, speculation=FIXED, runs=300, seed=11)


# -- batching, the prompt cache -------------------------------------------------------------------------------


def _count_draft_steps(monkeypatch) -> tuple[list[int], list[int]]:
    """The rows of every packed draft-model step (`DraftLM.packed`: one forward for all of them), and of every
    chained proposal a batch leaves to a row alone (engine/batch/propose.py's per-row path)."""
    from mlx_dspark.engine.batch import propose as batch_propose

    packed, alone = [], []
    real_packed, real_chained = DraftLM.packed, batch_propose._chained
    monkeypatch.setattr(DraftLM, "packed", lambda self, ids, caches: packed.append(len(caches)) or real_packed(self, ids, caches))
    monkeypatch.setattr(batch_propose, "_chained", lambda row, *args: alone.append(1) or real_chained(row, *args))
    return packed, alone


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_draft_model_rows_equal_their_solo_runs_drafting_together(pairs, family, monkeypatch):
    """Three rows of different prompt lengths and draft lengths, joining at different rounds: every chain step
    after the first is one packed forward of the draft (each row over its own caches: plain KV, a hybrid's
    recurrent states, wrapped sliding windows), and each row's tokens are its single request's."""
    from tests.batch_helpers import drive_batch

    target, _, partly = pairs[family]
    model = mlx_dspark.load(str(target), draft=str(partly))
    requests = [
        (PROMPT, GenerationOptions(max_tokens=24, speculation=SpeculationOptions(max_draft_tokens=4))),
        (PROMPT[:5], GenerationOptions(max_tokens=14)),
        ([7, 7, 3, 11, 13] * 2, GenerationOptions(max_tokens=18, speculation=SpeculationOptions(max_draft_tokens=2))),
    ]
    solo = [mlx_dspark.generate(model, prompt, options=options).tokens for prompt, options in requests]
    packed, alone = _count_draft_steps(monkeypatch)
    out, rows, widths = drive_batch(model, requests, joins=[0, 1, 0])
    assert max(widths) >= 3 and all(rows[i].chained for i in rows)
    assert any(0 < row.accepted < row.proposed for row in rows.values())
    assert max(packed, default=0) == 3 and not alone, f"the rows' chain steps ran packed: {packed}, {len(alone)} rows alone"
    for i in range(len(requests)):
        assert out[i] == solo[i], f"request {i}"


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_seeded_sampled_draft_model_rows_equal_their_runs_alone(pairs, family, monkeypatch):
    """Three seeded sampled rows (prompts and draft lengths of their own; the draft samples too, its q returned)
    drafted together, each with keys of its own stream: each row's tokens are those it gives alone in the
    batch (where it drafts by the same keys); another seed gives others."""
    from tests.batch_helpers import drive_batch

    target, _, partly = pairs[family]
    model = mlx_dspark.load(str(target), draft=str(partly))

    def sampled(seed, k, n):
        return GenerationOptions(max_tokens=n, sampling=SamplingOptions(temperature=0.9, seed=seed),
                                 speculation=SpeculationOptions(max_draft_tokens=k, draft_sampling="sample"))  # fmt: skip

    requests = [(PROMPT, sampled(7, 3, 20)), (PROMPT[:5], sampled(8, 4, 16)), ([7, 7, 3, 11, 13] * 2, sampled(9, 2, 18))]
    alone = [drive_batch(model, [request], joins=[0])[0][0] for request in requests]
    packed, per_row = _count_draft_steps(monkeypatch)
    out, rows, widths = drive_batch(model, requests, joins=[0, 1, 0])
    assert max(widths) == 3 and max(packed, default=0) == 3 and not per_row, (packed, len(per_row))
    assert any(0 < row.accepted < row.proposed for row in rows.values()), "sampled drafts, some accepted"
    for i in range(len(requests)):
        assert out[i] == alone[i], f"request {i}"
    other = drive_batch(model, [(PROMPT, sampled(10, 3, 20))], joins=[0])[0][0]
    assert other != alone[0], "another seed draws another sample"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_draft_model_chains_are_each_rows_own_and_drop_finished_rows(pairs, family, monkeypatch):
    """Rows whose caches read 12, 3 and 20 tokens (a wrapped window, a hybrid's states), chains of 4, 1 and 4
    drafts, a hook ending the third after two: each row drafts what its own proposal does (bitwise), a row
    leaves the packed steps when its chain ends (2, 2 rows, then the first alone), and every row's caches are
    back at its anchor, twice over."""
    from types import SimpleNamespace

    from mlx_dspark.engine.batch.chains import chains_packable, propose_chains

    target, _, partly = pairs[family]
    draft = mlx_dspark.load(str(target), draft=str(partly)).heads["lm"]
    committed = [PROMPT + [5, 6, 70], PROMPT[:3], (PROMPT * 3)[:20]]
    lengths = [4, 1, 4]
    hooks = [None, None, lambda row, tokens: None if len(tokens) == 2 else row]
    fresh = lambda c: LMProposer(draft, prompt=c, greedy=True, temperature=1.0)  # noqa: E731
    rows = [SimpleNamespace(proposer=fresh(c), position=len(c) - 1) for c in committed]
    assert chains_packable(rows)
    steps: list[int] = []
    real_step = LMProposer.chain_step
    monkeypatch.setattr(LMProposer, "chain_step", lambda self, rows, *a: steps.append(len(rows)) or real_step(self, rows, *a))
    for _ in range(2):
        steps.clear()
        together = propose_chains(rows, lengths, hooks)
        assert steps == [2, 2, 1], steps
        for i, c in enumerate(committed):
            own = fresh(c).propose(mx.array([c[-1]]), position=len(c) - 1, num_tokens=lengths[i], logits_hook=hooks[i])
            assert together[i].tokens.shape == (1, 2 if i == 2 else lengths[i])
            assert mx.array_equal(together[i].tokens, own.tokens).item(), i
            assert mx.array_equal(together[i].token_probs, own.token_probs).item(), i
            assert rows[i].proposer.state.entries == len(c) and rows[i].proposer.marked is None


def test_a_draft_model_whose_packed_step_fails_its_probe_drafts_per_row(pairs, monkeypatch):
    """A draft whose forward reads its cache's offset as an int outside its attention cannot take packed steps:
    its probe says why in one line, and each row drafts by itself, as before, its tokens its single request's."""
    from tests.batch_helpers import drive_batch

    target, _, partly = pairs["llama"]
    model = mlx_dspark.load(str(target), draft=str(partly))
    inner = model.heads["lm"].model

    class IntOffset(type(inner)):
        def __call__(self, inputs, cache=None, **kwargs):
            out = super().__call__(inputs, cache=cache, **kwargs)
            return out + 0 * int(cache[0].offset) if cache else out

    inner.__class__ = IntOffset
    problem = model.heads["lm"].packing_problem()
    assert problem.startswith("the draft model (model_type 'llama') fails in a packed step (ValueError: ") and "\n" not in problem
    requests = [(p, GenerationOptions(max_tokens=12, speculation=SpeculationOptions(max_draft_tokens=3))) for p in (PROMPT, PROMPT[:4])]
    packed, alone = _count_draft_steps(monkeypatch)
    out, _, widths = drive_batch(model, requests, joins=[0, 0])
    assert widths[0] == 2 and not packed and alone, "each row drafted alone"
    for i, (prompt, options) in enumerate(requests):
        assert out[i] == mlx_dspark.generate(model, prompt, options=options).tokens, i


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_prompt_cache_resumes_the_draft_model_exactly(pairs, family):
    """A next turn that extends the last (the draft keeps what it read: the warm run reads only the new tokens),
    then a prompt that leaves it early (it trims; a hybrid draft starts cold): each equal to a cold run and to
    plain decoding."""
    target, _, partly = pairs[family]
    model = mlx_dspark.load(str(target), draft=str(partly))
    cache = mlx_dspark.make_prompt_cache(model)
    first = mlx_dspark.generate(model, PROMPT, max_tokens=12, max_draft_tokens=3, prompt_cache=cache)
    state = cache.chains["lm"]
    read = state.entries
    assert read >= len(PROMPT) + 1
    second_prompt = PROMPT + first.tokens + [21, 22]
    reads = []
    read_tokens = LMProposer._read
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LMProposer, "_read", lambda self, tokens: reads.append(len(tokens)) or read_tokens(self, tokens))
        warm = mlx_dspark.generate(model, second_prompt, max_tokens=12, max_draft_tokens=3, prompt_cache=cache)
    assert reads[0] == len(second_prompt) + 1 - read  # its first catch-up: what it had not read, and the anchor
    assert warm.cached_tokens > len(PROMPT) and warm.tokens == plain(model, second_prompt, 12)
    assert warm.tokens == mlx_dspark.generate(model, second_prompt, max_tokens=12, max_draft_tokens=3).tokens
    third_prompt = PROMPT[:6] + [40, 41, 42]
    again = mlx_dspark.generate(model, third_prompt, max_tokens=12, max_draft_tokens=3, prompt_cache=cache)
    assert again.tokens == plain(model, third_prompt, 12)
    assert again.cached_tokens > 0 or family == "qwen3_5"  # a hybrid target resumes only at its snapshots


def test_the_chain_curve_of_a_draft_model_is_measured_over_its_own_steps(pairs, monkeypatch):
    """`auto`'s costs: engine/costs/probe.measure_chain_curve, generic over the registry, times the head's
    proposals of 1 and 4 drafts (the caches back at the anchor after each)."""
    monkeypatch.setattr(cost_probe, "measure_cost_curve", measure_cost_curve)  # the real one (conftest's is flat)
    target, _, partly = pairs["llama"]
    model = mlx_dspark.load(str(target), draft=str(partly))
    curve = measure_chain_curve(model.target, model.heads["lm"], head="lm", context=32, repeats=1)
    assert curve.draft_step_ms > 0 and len(curve.verify_ms) >= 8


# -- loading: detection, refusals, the command line ------------------------------------------------------------


def test_a_causal_lm_is_a_draft_model_and_the_other_heads_are_detected_as_before(pairs, tmp_path):
    from mlx_dspark.testing.eagle3_tiny import eagle3_config

    target = pairs["llama"][0]
    assert detect_head(read_config(target)) == "lm"
    assert detect_head(read_config(write_draft_for(tmp_path / "dspark", target_path=target))) == "draft"
    assert detect_head(eagle3_config(read_config(target), draft_vocab_size=64, aux_layer_ids=None)) == "eagle3"
    assert detect_head({"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant"}) == "assistant"
    assert detect_head({"model_type": "no_such_family"}) == "draft"  # the block draft's loader says what is missing


def test_a_draft_model_whose_tokenizer_differs_is_refused_in_one_line_naming_both_files(pairs, tmp_path):
    target, full, _ = pairs["llama"]
    other = tmp_path / "other"
    shutil.copytree(full, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError) as err:
        mlx_dspark.load(str(target), draft=str(other))
    line = str(err.value)
    assert "\n" not in line and str(other / "tokenizer.json") in line and str(target / "tokenizer.json") in line
    with pytest.raises(ValueError, match="draft_vocab applies to DSpark drafts; this is a draft model"):
        mlx_dspark.load(str(target), draft=str(full), draft_vocab=64)


def test_mlx_lms_flag_names_run_a_draft_model(pairs):
    from typer.testing import CliRunner

    from mlx_dspark.cli.generate import app

    target, _, partly = pairs["llama"]
    common = ["--model", str(target), "--prompt", "Hello there", "--max-tokens", "12", "--json"]
    spec = CliRunner().invoke(app, [*common, "--draft-model", str(partly), "--num-draft-tokens", "3"])
    base = CliRunner().invoke(app, [*common, "--no-draft"])
    assert spec.exit_code == 0 and base.exit_code == 0, spec.output + base.output
    ours, theirs = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (spec, base))
    assert ours["tokens"] == theirs["tokens"] and ours["speculative"] and max(map(int, ours["draft_lengths"])) == 3


@pytest.mark.parametrize(
    ("target", "draft"),
    [
        ("mlx-community/Qwen3-30B-A3B-4bit", "Qwen/Qwen3-0.6B"),
        ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-0.6B"),
        ("mlx-community/Llama-3.3-70B-Instruct-4bit", "mlx-community/Llama-3.2-1B-Instruct-4bit"),
        ("mlx-community/gemma-3-27b-it-bf16", "google/gemma-3-1b-it"),
    ],
)
def test_draft_auto_takes_the_familys_small_model_where_no_trained_head_is_known(target, draft):
    from mlx_dspark.loading.draft_registry import choose_draft, resolve_auto_draft

    patterns = []
    download = lambda repo, *, allow_patterns: patterns.extend(allow_patterns) or f"/cache/{repo}"  # noqa: E731
    reference, line = resolve_auto_draft(target, fetch_config=lambda repo: None, download=download)
    assert reference == f"/cache/{draft}" and "tokenizer.json" in patterns  # its tokenizer is compared with the target's
    assert line.startswith(f"draft auto: {draft} (draft model, ") and "no trained draft known" in line and "\n" not in line
    assert choose_draft(draft) is None  # the small model is no draft of itself


@pytest.mark.parametrize("target", ["mlx-community/Qwen3-8B-8bit", "mlx-community/Llama-3.1-8B-Instruct-4bit", "Qwen/Qwen3-32B"])
def test_a_trained_head_is_taken_before_the_familys_small_model_and_named_alone(target):
    from mlx_dspark.loading.draft_registry import choose_draft

    choice = choose_draft(target)
    assert choice.kind != "draft model" and not any("draft model" in other for other in choice.others)
