"""In-memory tiny targets and test-only proposers for the engine tests (no files, no tokenizer)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Sequence

import mlx.core as mx

from mlx_dspark.engine.round.decode import plain_steps
from mlx_dspark.models import target_model_class
from mlx_dspark.models.target.mlx_lm import from_config as target_from_config, probe_target
from mlx_dspark.engine.proposers.base import Proposal, Proposer
from mlx_dspark.engine.logits.sample import Sampler


def spark_config(*, vocab_size: int = 96, window: int = 16, tie: bool = True, layers: int = 4) -> dict:
    # the real pattern (three sliding, one full) repeated; 2 layers = one of each, for fast tests
    layer_types = ["sliding_attention", "full_attention"] if layers == 2 else (["sliding_attention"] * 3 + ["full_attention"]) * (layers // 4)
    return {
        "architectures": ["Spark2_5ForCausalLM"],
        "model_type": "spark2_5",
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": vocab_size,
        "layer_types": layer_types,
        "sliding_window": window,
        "rope_parameters": {
            "sliding_attention": {"rope_theta": 10000.0, "partial_rotary_factor": 1.0},
            "full_attention": {"rope_theta": 5000000.0, "partial_rotary_factor": 0.25},
        },
        "tie_word_embeddings": tie,
        "hidden_act": "gelu",
        "rms_norm_eps": 1e-6,
    }


def qwen3_config(*, vocab_size: int = 96, tie: bool = False, layers: int = 4) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
    }


def make_target(family: str, *, seed: int = 0, embedding_scale: float = 0.03, **config_overrides):
    """A random float32 target of the family (mlx-lm's class, as `load` builds it); embeddings scaled so
    logits are not flat."""
    mx.random.seed(seed)
    config = spark_config(**config_overrides) if family == "spark2_5" else qwen3_config(**config_overrides)
    model = target_from_config(config, model_class=target_model_class(config))
    if model.args.tie_word_embeddings:
        # With MLX's N(0, 1) embedding the residual stream is dominated by the input token and a tied
        # head just repeats it; a smaller embedding gives varied continuations (stronger tests).
        model.embedding.weight = model.embedding.weight * embedding_scale
    mx.eval(model.parameters())
    probe_target(model)
    return model


def greedy_reference(target, prompt: Sequence[int], length: int) -> list[int]:
    """The target's own greedy continuation, by plain decoding."""
    out: list[int] = []
    for step in plain_steps(target, prompt, sampler=Sampler()):
        out.extend(step.tokens)
        if len(out) >= length:
            return out[:length]
    raise AssertionError("unreachable")


class OracleProposer(Proposer):
    """Proposes the target's own greedy continuation, with errors injected at chosen draft positions.

    `errors(round_index)` returns the 1-based draft positions to corrupt in that round. It also records
    every feature block it is given, so tests can check the rollback bookkeeping.
    """

    def __init__(self, reference: Sequence[int], prompt_len: int, vocab_size: int, *, errors, tap_ids=(0,), block_size=7):
        self.reference = list(reference)
        self.prompt_len = prompt_len
        self.vocab_size = vocab_size
        self.errors = errors
        self.tap_ids = tuple(tap_ids)
        self.block_size = block_size
        self.rounds = 0
        self.extended = 0  # committed positions whose features we received

    def extend(self, features: mx.array) -> None:
        self.extended += features.shape[1]

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int) -> Proposal:
        assert self.extended == position, f"draft context holds {self.extended} positions, anchor at {position}"
        start = position - self.prompt_len + 1  # index in the reference of the token after the anchor
        tokens = list(self.reference[start : start + num_tokens])
        tokens += [0] * (num_tokens - len(tokens))
        for k in self.errors(self.rounds):
            if k <= num_tokens:
                tokens[k - 1] = (tokens[k - 1] + 1) % self.vocab_size
        self.rounds += 1
        return Proposal(tokens=mx.array([tokens], dtype=mx.int32))


def make_draft(
    target, *, seed: int = 0, markov_head_type: str = "vanilla", window: int = 4, layers: int = 2, layer_types=None,
    dflash2: dict | None = None,
):
    """A random in-memory DSpark draft of the target's family (copy of its config + DSpark fields).

    Its layers are all sliding unless `layer_types` says otherwise.
    """
    from mlx_dspark.models.heads.dspark.dflash2 import draft_class
    from mlx_dspark.models.heads.dspark.model import DraftArgs

    family = "spark2_5" if target.args.model_type == "spark2_5" else "qwen3"
    config = spark_config() if family == "spark2_5" else qwen3_config()
    config.update(
        vocab_size=target.args.vocab_size,
        architectures=["Spark2_5DSparkModel" if family == "spark2_5" else "Qwen3DSparkModel"],
        num_hidden_layers=layers,
        layer_types=list(layer_types) if layer_types else ["sliding_attention"] * layers,
        sliding_window=window,
        use_sliding_window=True,
        block_size=7,
        target_layer_ids=[0, target.args.num_hidden_layers - 2],
        mask_token_id=target.args.vocab_size - 1,
        markov_rank=4,
        markov_head_type=markov_head_type,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    if dflash2 is not None:  # a DFlash 2 draft (models/heads/dspark/dflash2.py): its fields, no DSpark heads
        config.update(dflash_config=dict(dflash2), markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False)
        config.pop("markov_head_type")
    mx.random.seed(seed)
    args = DraftArgs.from_dict(config, family=family)
    draft = draft_class(args)(args)
    if dflash2 is not None:  # random convolutions (tap 0 near the identity) and selector codebooks
        for layer in draft.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel = 0.2 * mx.random.normal(conv.base_kernel.shape) + mx.array([1.0, 0.0])[None, :, None][:, : conv.kernel_size]
        selector = draft.candidate_selector
        selector.predecessor_codebook = mx.random.normal(selector.predecessor_codebook.shape)
        selector.successor_codebook = mx.random.normal(selector.successor_codebook.shape)
    mx.eval(draft.parameters())
    return draft


def count_round(stats: Counter, step: Any) -> None:
    """Tally a verify round into `stats`: rounds, accepted drafts, rounds with a rejection."""
    if step.verified:
        stats["rounds"] += 1
        stats["accepted"] += step.accepted
        stats["rejected"] += step.accepted < step.proposed


def sampled_prefix(steps: Iterable[Any], length: int, stats: Counter) -> tuple[int, ...]:
    """The first `length` tokens a step generator commits, its verify rounds tallied into `stats`."""
    tokens: list[int] = []
    for step in steps:
        tokens.extend(step.tokens)
        count_round(stats, step)
        if len(tokens) >= length:
            break
    return tuple(tokens[:length])


def assert_chain_sampling_is_exact(target, make_proposer, *, sampler: Sampler, speculation: Any, runs: int, seed: int) -> None:
    """`runs` sampled speculative generations of 3 tokens after test_lossless_sampling's PROMPT, each with a fresh
    `make_proposer()`, against the target's exact joint distribution: chi-square on the joint and every marginal,
    with some drafts accepted and some rejected (both paths of the acceptance ran)."""
    from mlx_dspark.engine.round.decode import speculative_steps
    from tests.test_lossless_sampling import PROMPT, chi_square_p_value, exact_distribution, marginals, to_array

    exact = exact_distribution(target, sampler, 3)
    mx.random.seed(seed)
    outcomes, stats = Counter(), Counter()
    for _ in range(runs):
        steps = speculative_steps(target, make_proposer(), PROMPT, sampler=sampler, speculation=speculation)
        outcomes[sampled_prefix(steps, 3, stats)] += 1
    assert stats["accepted"] > 0 and stats["rejected"] > stats["rounds"] // 5
    counts = to_array(outcomes, 3)
    assert chi_square_p_value(counts.reshape(-1), exact.reshape(-1)) > 1e-4
    for observed, expected in zip(marginals(counts), marginals(exact)):
        assert chi_square_p_value(observed, expected) > 1e-4
