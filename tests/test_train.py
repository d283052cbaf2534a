"""Training DSpark drafts (mlx_dspark.train) on the tiny random pairs: forward, loss, fine-tuning,
save/load/convert, resume, calibration, and losslessness with a trained draft."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_dspark
from mlx_dspark.loading.convert import convert
from mlx_dspark.testing.tiny import write_tiny_draft
from mlx_dspark.train.calibration import (
    CALIBRATION_FILE,
    calibrate_draft,
    expected_calibration_error,
    fit_temperature,
    write_calibration,
)
from mlx_dspark.train.data import Batch, Batches, Chunk, load_chunks
from mlx_dspark.train.forward import Anchors, block_targets, draft_forward, target_pass
from mlx_dspark.train.loop import Trainer, TrainOptions, evaluate
from mlx_dspark.train.losses import LossWeights
from mlx_dspark.train.session import DataOptions, DraftShape, train_draft

TEXT = (
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n"
    "The quick brown fox jumps over the lazy dog. 1 2 3 4 5 6 7 8 9 10.\n"
)
SHAPE = DraftShape(num_layers=2, num_taps=2, sliding_window=16, markov_rank=16)


def params(model) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpus")
    (root / "train").mkdir()
    for i in range(3):
        (root / "train" / f"doc{i}.txt").write_text(TEXT * (2 + i), encoding="utf-8")
    (root / "valid.txt").write_text(TEXT * 3, encoding="utf-8")
    return {"train": root / "train", "valid": root / "valid.txt"}


def small_options(**overrides) -> TrainOptions:
    values = dict(steps=6, anchors=8, lr=3e-3, seed=0, progress=False)
    values.update(overrides)
    return TrainOptions(**values)


@pytest.fixture(scope="module")
def trained(tiny_qwen3_target, corpus, tmp_path_factory) -> Path:
    """A draft trained from scratch for a few steps, calibrated on the held-out file."""
    out = tmp_path_factory.mktemp("trained") / "draft"
    train_draft(
        tiny_qwen3_target,
        out,
        data=DataOptions(train=[str(corpus["train"])], valid=[str(corpus["valid"])], seq_len=64, batch_size=2),
        options=small_options(steps=8),
        shape=SHAPE,
        calibrate="greedy",
        log=lambda message: None,
    )
    return out


def test_training_forward_equals_the_inference_block_forward(tiny_spark_target, tmp_path):
    # a sliding and a full-attention layer; anchors before, inside and past the window (16)
    draft_path = write_tiny_draft(
        tmp_path / "draft", target_path=tiny_spark_target, layer_types=["sliding_attention", "full_attention"], seed=3
    )
    pair = mlx_dspark.load(str(tiny_spark_target), draft=str(draft_path))
    draft, target = pair.draft, pair.target
    tokens = np.random.default_rng(0).integers(10, 300, size=(2, 40)).astype(np.int32)
    batch = Batch(tokens, np.ones(tokens.shape, dtype=bool))
    anchors = Anchors(np.array([0, 0, 0, 1, 1], np.int32), np.array([0, 5, 30, 17, 38], np.int32))
    logits, features = target_pass(target, mx.array(tokens), tuple(draft.args.target_layer_ids))
    targets = block_targets(batch, anchors, logits, block_size=draft.args.block_size)
    for checkpoint in (False, True):
        out = draft_forward(draft, target, features, mx.array(tokens), anchors, targets.prev, checkpoint=checkpoint)
        for i, (b, p) in enumerate(zip(anchors.seq.tolist(), anchors.pos.tolist())):
            context = draft.make_cache()
            draft.append_context(features[b : b + 1, :p], context)
            anchor = mx.array([int(tokens[b, p])])
            expected = draft.block_hidden(anchor, context, target=target)[0]
            np.testing.assert_allclose(np.array(out.hidden[i]), np.array(expected), atol=1e-5)
            # position 1: the Markov input is the anchor; sampled drafting at T = 1 returns softmax(logits(1))
            proposal = draft.propose(anchor, context, target=target, greedy=False, temperature=1.0)
            np.testing.assert_allclose(
                np.array(mx.softmax(out.logits[i, 0], axis=-1)), np.array(proposal.draft_probs[0, 0]), atol=1e-6
            )
            np.testing.assert_allclose(
                float(mx.sigmoid(out.confidence_logits[i, 0])), float(proposal.confidence[0, 0]), atol=1e-5
            )
    # the comparison can fail: a training forward with another window differs for an anchor past it
    context = draft.make_cache()
    draft.append_context(features[0:1, :30], context)
    reference = draft.block_hidden(mx.array([int(tokens[0, 30])]), context, target=target)[0]
    narrow_path = write_tiny_draft(
        tmp_path / "narrow", target_path=tiny_spark_target, layer_types=["sliding_attention", "full_attention"],
        sliding_window=8, seed=3,
    )  # fmt: skip
    narrow = mlx_dspark.load(str(tiny_spark_target), draft=str(narrow_path)).draft
    narrow.update(draft.parameters())  # the same weights, only the window differs
    out = draft_forward(narrow, target, features, mx.array(tokens), anchors, targets.prev)
    assert float(mx.abs(out.hidden[2] - reference).max()) > 1e-2


def test_block_targets_stop_at_the_end_and_untrainable_tokens():
    tokens = np.arange(10, dtype=np.int32)[None]
    mask = np.array([[False, True, True, True, True, False, True, True, True, True]])
    logits = mx.broadcast_to(mx.arange(10, dtype=mx.float32)[None, :, None], (1, 10, 4))  # logit = position
    anchors = Anchors(np.array([0, 0], np.int32), np.array([2, 7], np.int32))
    out = block_targets(Batch(tokens, mask), anchors, logits, block_size=4)
    assert np.array(out.labels).tolist() == [[3, 4, 5, 6], [8, 9, 9, 9]]
    assert np.array(out.prev).tolist() == [[2, 3, 4, 5], [7, 8, 9, 9]]
    assert np.array(out.valid).tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]
    assert np.array(out.target_logits[:, :, 0]).tolist() == [[2, 3, 4, 5], [7, 8, 8, 8]]  # predictor = label - 1


def test_a_few_training_steps_lower_the_loss(tiny_qwen3_pair, corpus):
    pair = mlx_dspark.load(*map(str, tiny_qwen3_pair))
    chunks = load_chunks([corpus["train"]], pair.tokenizer, seq_len=48)
    options = small_options(steps=12)
    batches = Batches(chunks, batch_size=2, seed=0, pad_id=0)
    trainer = Trainer(pair.draft, pair.target, pair.draft_config, batches, options, out_dir=Path("unused"), fingerprint={})

    def held_loss() -> float:
        return evaluate(pair.draft, pair.target, chunks[:4], batch_size=2, anchors=8, seed=1, losses=options.losses, pad_id=0)["loss"]

    before = held_loss()
    losses = [trainer.step(step)["loss"] for step in range(options.steps)]
    after = held_loss()
    assert after < 0.9 * before
    assert np.mean(losses[-3:]) < np.mean(losses[:3])


def test_gradient_checkpointing_gives_the_same_gradients(tiny_spark_pair, corpus):
    pair = mlx_dspark.load(*map(str, tiny_spark_pair))
    chunks = load_chunks([corpus["train"]], pair.tokenizer, seq_len=48)
    batch = Batches(chunks, batch_size=2, seed=0, pad_id=0)(0)
    grads = []
    for checkpoint in (False, True):
        trainer = Trainer(
            pair.draft, pair.target, pair.draft_config, Batches(chunks, batch_size=2, seed=0, pad_id=0),
            small_options(grad_checkpoint=checkpoint), out_dir=Path("unused"), fingerprint={},
        )  # fmt: skip
        _, g = trainer.loss_and_grads(batch, np.random.default_rng(5))
        grads.append(dict(tree_flatten(g)))
    for name, value in grads[0].items():
        np.testing.assert_allclose(np.array(grads[1][name]), np.array(value), rtol=1e-4, atol=1e-6, err_msg=name)


def test_fine_tuning_starts_from_the_existing_draft(tiny_qwen3_pair, corpus, tmp_path):
    target, draft = tiny_qwen3_pair
    original = params(mlx_dspark.load(str(target), draft=str(draft)).draft)
    out = tmp_path / "tuned"
    train_draft(
        target,
        out,
        data=DataOptions(train=[str(corpus["train"])], seq_len=48, batch_size=2),
        options=small_options(steps=2, lr=1e-9),  # a negligible step: the result is the starting point
        init_draft=str(draft),
        log=lambda message: None,
    )
    tuned = params(mlx_dspark.load(str(target), draft=str(out)).draft)
    assert tuned.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_allclose(tuned[name], value, atol=1e-6, err_msg=name)
    source_config = json.loads((draft / "config.json").read_text())
    tuned_config = json.loads((out / "config.json").read_text())
    for key in ("target_layer_ids", "block_size", "mask_token_id", "layer_types", "markov_rank", "num_hidden_layers"):
        assert tuned_config[key] == source_config[key]


def test_trained_draft_round_trips_through_load_and_convert(trained, tiny_qwen3_target, tmp_path):
    config = json.loads((trained / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["target_layer_ids"] == [0, 2]
    assert (trained / "model.safetensors").is_file() and (trained / "training.json").is_file()
    loaded = mlx_dspark.load(str(tiny_qwen3_target), draft=str(trained))
    stored = mx.load(str(trained / "model.safetensors"))
    assert sorted(stored) == sorted(k for k, _ in tree_flatten(loaded.draft.parameters()))
    converted = convert(trained, tmp_path / "mlx", log=lambda message: None)
    again = mlx_dspark.load(str(tiny_qwen3_target), draft=str(converted))
    for name, value in params(loaded.draft).items():
        np.testing.assert_array_equal(params(again.draft)[name], value)
    assert again.draft.confidence_head.temperatures == loaded.draft.confidence_head.temperatures
    prompt = "def add(a, b):\n"
    assert mlx_dspark.generate(again, prompt, max_tokens=12).tokens == mlx_dspark.generate(loaded, prompt, max_tokens=12).tokens


def test_training_learns_to_predict_the_target(trained, tiny_qwen3_target, corpus):
    summary = json.loads((trained / "training.json").read_text())
    assert summary["steps"] == 8 and summary["peak_memory_gb"] > 0
    # a random draft's teacher-forced sampled acceptance length is ~1 (it never agrees with the target)
    assert summary["held_out_metrics"]["tau_sampled"] > 1.2


def test_resume_continues_exactly_where_the_run_stopped(tiny_qwen3_target, corpus, tmp_path):
    data = DataOptions(train=[str(corpus["train"])], seq_len=48, batch_size=2)
    run = dict(data=data, options=small_options(steps=4, checkpoint_every=2), shape=SHAPE, log=lambda message: None)
    out = train_draft(tiny_qwen3_target, tmp_path / "run", **run)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]
    straight = mx.load(str(out / "model.safetensors"))
    for name in ("model.safetensors", "config.json"):
        (out / name).unlink()  # as if the run had been stopped after its checkpoint
    train_draft(tiny_qwen3_target, out, resume=True, **run)
    resumed = mx.load(str(out / "model.safetensors"))
    for name, value in straight.items():
        np.testing.assert_array_equal(np.array(resumed[name]), np.array(value), err_msg=name)
    with pytest.raises(ValueError, match="cannot resume with other settings"):
        train_draft(tiny_qwen3_target, out, resume=True, **{**run, "options": small_options(steps=4, lr=1e-2)})
    with pytest.raises(ValueError, match="not empty"):
        train_draft(tiny_qwen3_target, out, **run)


def test_fit_temperature_recovers_a_known_temperature_and_lowers_the_ece():
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 4.0, size=20000)
    labels = (rng.random(20000) < 1 / (1 + np.exp(-logits / 2.5))).astype(float)  # true T = 2.5
    weights = np.ones_like(logits)
    temperature = fit_temperature(logits, labels, weights)
    assert abs(temperature - 2.5) < 0.15
    before = expected_calibration_error(1 / (1 + np.exp(-logits)), labels, weights)
    after = expected_calibration_error(1 / (1 + np.exp(-logits / temperature)), labels, weights)
    assert after < 0.02 < before


def test_calibration_stores_temperatures_that_load_back_and_scale_the_confidence(trained, tiny_qwen3_target, corpus, tmp_path):
    config = json.loads((trained / "config.json").read_text())
    temperatures = config["confidence_temperatures"]
    report = json.loads((trained / CALIBRATION_FILE).read_text())
    assert len(temperatures) == config["block_size"] == len(report["ece_before"]) == len(report["ece_after"])
    assert report["temperatures"] == temperatures and all(t > 0 for t in temperatures)
    # fitting minimizes each position's NLL, and T = 1 is one of the candidates
    assert all(after <= before + 1e-9 for before, after in zip(report["nll_before"], report["nll_after"]))

    calibrated = mlx_dspark.load(str(tiny_qwen3_target), draft=str(trained))
    assert calibrated.draft.confidence_head.temperatures == tuple(temperatures)
    raw_dir = tmp_path / "raw"
    shutil.copytree(trained, raw_dir)
    raw_config = dict(config)
    del raw_config["confidence_temperatures"]
    (raw_dir / "config.json").write_text(json.dumps(raw_config))
    raw = mlx_dspark.load(str(tiny_qwen3_target), draft=str(raw_dir))
    assert raw.draft.confidence_head.temperatures is None
    # the same block: calibrated c(k) = sigmoid(logit / T(k)) of the raw logit
    anchor = mx.array([17])
    outputs = []
    for model in (raw, calibrated):
        context = model.draft.make_cache()
        _, features = model.target(mx.array([[5, 9, 17, 30, 17]]), tap_ids=tuple(model.draft.args.target_layer_ids))
        model.draft.append_context(features, context)
        outputs.append(np.array(model.draft.propose(anchor, context, target=model.target).confidence[0]))
    raw_logit = np.log(outputs[0] / (1 - outputs[0]))
    np.testing.assert_allclose(outputs[1], 1 / (1 + np.exp(-raw_logit / np.array(temperatures))), rtol=1e-4, atol=1e-6)

    # recalibrating writes the same fields again
    pair = mlx_dspark.load(str(tiny_qwen3_target), draft=str(raw_dir))
    chunks = load_chunks([corpus["valid"]], pair.tokenizer, seq_len=64)
    again = calibrate_draft(pair.draft, pair.target, chunks, kind="sampled", batch_size=2, anchors=8)
    write_calibration(raw_dir, again)
    assert json.loads((raw_dir / "config.json").read_text())["confidence_temperatures"] == again.temperatures


def test_confidence_temperatures_are_validated(tiny_qwen3_pair, tmp_path):
    target, draft = tiny_qwen3_pair
    bad = tmp_path / "bad"
    shutil.copytree(draft, bad)
    config = json.loads((bad / "config.json").read_text())
    config["confidence_temperatures"] = [1.0, 2.0]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="confidence_temperatures.*7 positive numbers"):
        mlx_dspark.load(str(target), draft=str(bad))


@pytest.mark.parametrize("prompt", ["def add(a, b):\n", "The quick brown fox " * 4])
def test_greedy_with_a_trained_draft_is_token_identical_to_plain_greedy(trained, tiny_qwen3_target, prompt):
    pair = mlx_dspark.load(str(tiny_qwen3_target), draft=str(trained))
    plain = mlx_dspark.generate(pair, prompt, max_tokens=40, speculative=False)
    spec = mlx_dspark.generate(pair, prompt, max_tokens=40)
    assert spec.tokens == plain.tokens
    assert spec.acceptance_lengths


def test_sampling_with_a_trained_draft_matches_the_exact_target_distribution(monkeypatch):
    from mlx_dspark.engine.proposers.dspark import DraftProposer
    from mlx_dspark.engine.logits.sample import Sampler
    from tests import test_lossless_sampling as harness
    from tests.engine_helpers import make_draft, make_target

    monkeypatch.setattr(harness, "RUNS", 300)  # a third of the harness's runs: this is one more draft
    target = make_target("qwen3", seed=5, vocab_size=harness.VOCAB, layers=4, embedding_scale=0.5)
    draft = make_draft(target, seed=6)
    rng = np.random.default_rng(0)
    chunks = [Chunk(rng.integers(0, harness.VOCAB - 1, size=24).tolist(), [True] * 24) for _ in range(16)]
    options = small_options(steps=15, lr=1e-2)
    batches = Batches(chunks, batch_size=4, seed=0, pad_id=0)
    trainer = Trainer(draft, target, {}, batches, options, out_dir=Path("unused"), fingerprint={})

    def tau() -> float:
        return evaluate(draft, target, chunks, batch_size=8, anchors=8, seed=1, losses=options.losses, pad_id=0)["tau_sampled"]

    before = tau()
    for step in range(options.steps):
        trainer.step(step)
    assert tau() > before + 0.2  # the draft learned something of the target

    sampler = Sampler(temperature=1.0)
    exact = harness.exact_distribution(target, sampler, 3)
    proposer = lambda: DraftProposer(draft, target, greedy=False, temperature=1.0)  # noqa: E731
    outcomes = harness.sample_runs(target, sampler, proposer, length=3, seed=77)
    assert outcomes.stats["accepted"] > 0
    counts = harness.to_array(outcomes, 3)
    assert harness.chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > harness.MIN_P_VALUE
    for observed, expected in zip(harness.marginals(counts), harness.marginals(exact)):
        assert harness.chi_square_p_value(observed, expected) > harness.MIN_P_VALUE


def test_jsonl_records_set_the_loss_mask(tiny_qwen3_pair, tmp_path):
    pair = mlx_dspark.load(str(tiny_qwen3_pair[0]))
    tok = pair.tokenizer
    path = tmp_path / "data.jsonl"
    records = [
        {"prompt": "Hello, world!", "completion": " How are you today?"},
        {"messages": [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "three four"}]},
        {"text": "1 2 3 4 5 6"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    chunks = load_chunks([path], tok, seq_len=256)
    prompt_len = len(tok.encode("Hello, world!"))
    assert chunks[0].loss_mask == [False] * prompt_len + [True] * (len(chunks[0].tokens) - prompt_len)
    assert chunks[0].tokens[-1] == tok.eos_token_id
    chat = chunks[1]
    trained_text = tok.decode([t for t, m in zip(chat.tokens, chat.loss_mask) if m])
    assert "three four" in trained_text and "one two" not in trained_text
    assert all(chunks[2].loss_mask)
    path.write_text('{"text": "ok"}\n{"question": "no"}\n')
    with pytest.raises(ValueError, match=r"data.jsonl:2: a record needs"):
        load_chunks([path], tok, seq_len=256)


def test_calibration_draws_a_reliability_plot(trained, tiny_qwen3_target, corpus, tmp_path):
    pytest.importorskip("matplotlib")
    pair = mlx_dspark.load(str(tiny_qwen3_target), draft=str(trained))
    chunks = load_chunks([corpus["valid"]], pair.tokenizer, seq_len=64)
    calibrate_draft(pair.draft, pair.target, chunks, batch_size=2, anchors=8, plot=tmp_path / "reliability.png")
    assert (tmp_path / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_shipped_demo_pair_drafts_well_and_stays_lossless():
    # The one test that reads the shipped pair (package data), the way the commands load it without --model.
    from mlx_dspark.cli.common import demo_pair

    demo = demo_pair()
    pair = mlx_dspark.load(str(demo.target), draft=str(demo.draft), dtype=demo.dtype)
    assert len(pair.draft.confidence_head.temperatures) == pair.draft.args.block_size  # calibrated
    # generate / benchmark send it raw text (a str prompt is never templated); chat and the server use its small
    # ChatML template with tools (tests/test_chat_cli.py, tests/test_server_agents.py)
    assert pair.tokenizer.has_chat_template and "tools" in pair.tokenizer.chat_template
    for prompt in (demo.prompt, "import os\nimport sys\n\n\ndef main(argv):\n    "):
        plain = mlx_dspark.generate(pair, prompt, max_tokens=48, speculative=False)
        # full blocks, the draft alone: its acceptance, whatever cost curve a subprocess test of this
        # session cached for the demo pair (auto then parks it on this CPU) and whatever lookup finds
        spec = mlx_dspark.generate(pair, prompt, max_tokens=48, max_draft_tokens=7, lookup="off")
        assert spec.tokens == plain.tokens
        assert spec.mean_acceptance_length > 2.0  # a trained draft, not a random one (about 1.0)
