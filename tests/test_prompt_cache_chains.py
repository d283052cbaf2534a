"""The prompt cache with a chained head (issue 35.5): the target's own MTP layers (Qwen3.5: a hybrid target;
MiMo: full attention), an EAGLE-3 draft (llama target) and a Gemma 4 assistant (sliding layers) resume a
conversation as the block draft does.

Each resumed generation is checked against a cold one: the same output (and plain decoding's, greedy) and
the same proposals, block for block, which only an exactly resumed drafter state gives (the output alone is
lossless whatever the drafter holds). Tiny float32 checkpoints written once per module.
"""

from __future__ import annotations

import random
from collections import Counter

import mlx.core as mx
import pytest

import mlx_dspark
from mlx_dspark.engine.proposers import loaded_heads
from mlx_dspark.engine.round.decode import speculative_steps
from mlx_dspark.engine.proposers.eagle3 import Eagle3Proposer
from mlx_dspark.engine.proposers.gemma4_assistant import AssistantProposer
from mlx_dspark.engine.proposers.mtp import MTPProposer
from mlx_dspark.engine.options import SpeculationOptions
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.testing.eagle3_tiny import write_eagle3_draft
from mlx_dspark.testing.gemma4_assistant_tiny import write_assistant
from mlx_dspark.testing.mlx_lm_checkpoints import write_tiny_mlx_lm_target
from mlx_dspark.testing.mtp_mimo_tiny import write_tiny_mimo_target
from mlx_dspark.testing.mtp_tiny import write_tiny_qwen3_5_mtp_target
from mlx_dspark.testing.tiny import write_tiny_draft
from tests.engine_helpers import sampled_prefix

OUT = 16  # tokens generated per turn
PROMPT = 40  # first prompt's length (snapshots at 23 and 39)
FIXED = SpeculationOptions(max_draft_tokens=3)
PROPOSERS = {"mtp": MTPProposer, "eagle3": Eagle3Proposer, "assistant": AssistantProposer}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(target, draft) per pair: a path, or "mtp" for the target's own layers."""
    root = tmp_path_factory.mktemp("chain_cache")
    llama = write_tiny_mlx_lm_target(root / "llama", family="llama", seed=0)
    gemma = write_tiny_mlx_lm_target(root / "gemma4", family="gemma4_text", seed=0, sliding_window=8)
    return {
        "mtp-qwen3_5": (write_tiny_qwen3_5_mtp_target(root / "qwen3_5", seed=0), "mtp"),
        "mtp-mimo": (write_tiny_mimo_target(root / "mimo", seed=0), "mtp"),
        "eagle3": (llama, str(write_eagle3_draft(root / "eagle3", target_path=llama, seed=5))),
        "assistant": (gemma, str(write_assistant(root / "assistant", target_path=gemma, seed=1, table_scale=4.0))),
    }


@pytest.fixture(scope="module")
def pairs(checkpoints):
    return {name: mlx_dspark.load(str(target), draft=draft) for name, (target, draft) in checkpoints.items()}


def head_of(model) -> str:
    return next(name for name in PROPOSERS if model.heads.get(name) is not None)


class Recording:
    """A proposer that keeps every proposed block: equal blocks mean equal drafter states."""

    def __init__(self, inner, blocks: list):
        self.inner, self.blocks = inner, blocks

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, anchor, **options):
        proposal = self.inner.propose(anchor, **options)
        self.blocks.append(proposal.tokens[0].tolist())
        return proposal


def run(model, prompt, *, cache=None, temperature=0.0, blocks=None, n=OUT, chains=None, flush=True):
    """The first n tokens of a speculative generation with the pair's head (over `cache`'s state for it);
    the proposer's chains are appended to `chains` when given. `flush`: the waiting entries go in when the
    consumer stops, as api.stream_generate's steps do (steps._flushed); else they wait in the cache."""
    head = head_of(model)
    drafter, sampler = model.heads[head], Sampler(temperature=temperature)
    held = {} if cache is None or head == "assistant" else {"context": cache.chain_context(head, drafter.make_cache)}
    inner = PROPOSERS[head](drafter, model.target, prompt=prompt, greedy=sampler.greedy,
                            temperature=max(temperature, 1e-6), block_size=3, **held)  # fmt: skip
    proposer = Recording(inner, [] if blocks is None else blocks)
    (chains if chains is not None else []).extend(inner.chains)
    steps = speculative_steps(model.target, proposer, prompt, sampler=sampler, speculation=FIXED, prompt_cache=cache)
    out = list(sampled_prefix(steps, n, Counter()))
    steps.close()
    if flush:
        inner.flush()
    return out


def assert_same_drafter_state(warm: list, cold: list) -> None:
    """The drafter caches hold the same entries (keys and values) and the same committed tokens."""
    for a, b in zip(warm, cold, strict=True):
        assert a.entries == b.entries and a.tokens == b.tokens
        for x, y in zip(a.cache, b.cache, strict=True):
            assert x.offset == y.offset
            for u, v in ((x.keys, y.keys), (x.values, y.values)):
                assert mx.allclose(u[..., : x.offset, :], v[..., : y.offset, :], atol=1e-5).item()


def first_turn(model, seed=7):
    cache = mlx_dspark.make_prompt_cache(model)
    rng, vocab = random.Random(seed), model.target.args.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(PROMPT)]
    return cache, prompt, run(model, prompt, cache=cache)


def next_token(model, cache) -> int:
    """The token the target committed after the held ones (the last anchor, or one past the output)."""
    head = head_of(model)
    if head == "assistant":
        return -1
    return cache.chains[head].tokens[len(cache.tokens)]


def second_prompt(kind: str, model, cache, prompt: list[int], out: list[int]) -> list[int]:
    vocab = model.target.args.vocab_size
    new = [5, 9, 11, 4]
    if kind == "extend":  # the history as it was, then a new turn
        return prompt + out + new
    if kind == "after_stop":  # a stop after 10 tokens: the cache forgets what the round committed past it
        cache.forget_past(prompt + out[:10])
        return prompt + out[:10] + new
    if kind == "next_changed":  # the held tokens, then another token than the one the drafter paired with
        held = list(cache.tokens)
        return held + [(max(next_token(model, cache), 3) + 1) % vocab] + new
    at = {"in_prompt": 30, "in_reply": PROMPT + 8}[kind]
    history = prompt + out
    return history[:at] + [(history[at] + 1) % vocab] + new


PAIRS = ["mtp-qwen3_5", "mtp-mimo", "eagle3", "assistant"]
# where the second turn resumes: a chain re-prefills the last common position when its entry's next token
# changed (its features are kept only for the newest entry); the hybrid Qwen3.5 and Gemma 4's sliding
# layers roll back only within their latest forward, else from the snapshots at 39 and 23
EXPECTED = {
    ("mtp-qwen3_5", "in_prompt"): PROMPT - 1 - 16,
    ("mtp-qwen3_5", "in_reply"): PROMPT - 1,
    ("mtp-mimo", "in_prompt"): 29,
    ("mtp-mimo", "in_reply"): PROMPT + 7,
    ("eagle3", "in_prompt"): 29,
    ("eagle3", "in_reply"): PROMPT + 7,
    ("assistant", "in_prompt"): PROMPT - 1 - 16,
    ("assistant", "in_reply"): PROMPT - 1,
    ("mtp-qwen3_5", "after_stop"): PROMPT - 1,
    ("assistant", "after_stop"): PROMPT - 1,
}


@pytest.mark.parametrize("kind", ["extend", "next_changed", "in_prompt", "in_reply", "after_stop"])
@pytest.mark.parametrize("pair", PAIRS)
def test_a_second_turn_resumes_the_heads_state_and_drafts_as_a_cold_run(pairs, pair, kind):
    model = pairs[pair]
    cache, prompt, out = first_turn(model)
    second = second_prompt(kind, model, cache, prompt, out)
    expected = cache.reusable(second, speculative=True)
    held = len(cache.tokens)
    warm_blocks, cold_blocks, warm_chains, cold_chains = [], [], [], []
    warm = run(model, second, cache=cache, blocks=warm_blocks, chains=warm_chains)
    assert warm == run(model, second, blocks=cold_blocks, chains=cold_chains)
    assert warm_blocks == cold_blocks  # the resumed drafter state is the cold one: the same proposals
    assert_same_drafter_state(warm_chains, cold_chains)
    assert cache.cached_tokens == expected
    if kind in ("extend", "next_changed"):
        assert cache.cached_tokens == held  # the whole held sequence; the boundary entry written again
    elif kind == "after_stop":  # the entry at the stop pairs with a forgotten token: one position before it
        assert cache.cached_tokens == EXPECTED.get((pair, kind), PROMPT + 9)
    else:
        assert cache.cached_tokens == EXPECTED[pair, kind]
    plain = mlx_dspark.generate(model, second, max_tokens=OUT, speculative=False).tokens
    assert warm == plain


@pytest.mark.parametrize("pair", PAIRS)
def test_a_third_turn_after_an_unflushed_resumed_one_still_drafts_as_a_cold_run(pairs, pair):
    model = pairs[pair]
    cache, prompt, out = first_turn(model, seed=3)
    second = second_prompt("in_reply", model, cache, prompt, out)
    out_2 = run(model, second, cache=cache, flush=False)  # its last round's entries wait in the prompt cache
    third = second + out_2[:5] + [7, 8]
    warm_blocks, cold_blocks = [], []
    assert run(model, third, cache=cache, blocks=warm_blocks) == run(model, third, blocks=cold_blocks)
    assert warm_blocks == cold_blocks and cache.cached_tokens >= len(second) - 1  # hybrids: the snapshot at its end


@pytest.mark.parametrize("pair", PAIRS)
def test_a_sampled_second_turn_equals_a_cold_run_with_the_same_seed(pairs, pair):
    model = pairs[pair]
    cache = mlx_dspark.make_prompt_cache(model)
    prompt = list(range(50, 90))
    mx.random.seed(0)
    out = run(model, prompt, cache=cache, temperature=1.0)
    second = prompt + out + [5, 9, 11]
    warm_blocks, cold_blocks = [], []
    mx.random.seed(1)
    warm = run(model, second, cache=cache, temperature=1.0, blocks=warm_blocks)
    assert cache.cached_tokens >= len(prompt)
    mx.random.seed(1)
    assert warm == run(model, second, temperature=1.0, blocks=cold_blocks)
    assert warm_blocks == cold_blocks


@pytest.mark.parametrize("pair", ["mtp-mimo", "assistant"])
def test_api_turns_with_a_prompt_cache_report_cached_tokens_and_decode_as_cold_and_plain(pairs, pair):
    model = pairs[pair]
    cache = mlx_dspark.make_prompt_cache(model)
    first_prompt = list(range(20, 60))
    first = mlx_dspark.generate(model, first_prompt, max_tokens=12, prompt_cache=cache)
    assert first.cached_tokens == 0
    second_prompt = first_prompt + first.tokens + [7, 8, 9]
    warm = mlx_dspark.generate(model, second_prompt, max_tokens=12, prompt_cache=cache)
    cold = mlx_dspark.generate(model, second_prompt, max_tokens=12)
    assert warm.cached_tokens >= len(first_prompt) and cold.cached_tokens == 0
    assert warm.tokens == cold.tokens == mlx_dspark.generate(model, second_prompt, max_tokens=12, speculative=False).tokens
    assert warm.acceptance_lengths == cold.acceptance_lengths  # the same proposals, round by round


def test_a_chain_over_a_state_of_its_own_or_after_a_plain_turn_starts_cold_and_another_caches_is_refused(pairs):
    model = pairs["mtp-mimo"]
    cache, prompt, out = first_turn(model)
    second = prompt + out + [4, 5]
    own = MTPProposer(model.heads["mtp"], model.target, prompt=second, greedy=True, temperature=1.0, block_size=3)
    steps = speculative_steps(model.target, own, second, sampler=Sampler(), speculation=FIXED, prompt_cache=cache)
    next(steps)
    steps.close()
    assert cache.cached_tokens == 0  # its drafter cache is not the prompt cache's: nothing to resume from
    third = second + [6]
    mlx_dspark.generate(model, third, max_tokens=4, prompt_cache=cache, speculative=False)
    fourth = third + [7]
    assert run(model, fourth, cache=cache) == run(model, fourth)
    assert cache.cached_tokens == 0  # the chain did not follow the plain turn
    other = mlx_dspark.make_prompt_cache(model)
    foreign = MTPProposer(model.heads["mtp"], model.target, prompt=fourth, greedy=True, temperature=1.0,
                          context=cache.chain_context("mtp", model.heads["mtp"].make_cache))  # fmt: skip
    with pytest.raises(ValueError, match=r"context=prompt_cache.chain_context\(name, drafter.make_cache\)"):
        next(speculative_steps(model.target, foreign, fourth, sampler=Sampler(), prompt_cache=other))


@pytest.mark.parametrize("heads", ["dspark+mtp", "eagle3+mtp", "dspark+eagle3+mtp"])
def test_several_heads_resume_together_and_decode_as_a_cold_run(checkpoints, heads, tmp_path):
    target = checkpoints["mtp-qwen3_5"][0]
    files = []
    if "dspark" in heads:
        files.append(write_tiny_draft(tmp_path / "draft", target_path=target, seed=1, layer_family="qwen3", include_shared=False))
    if "eagle3" in heads:
        files.append(write_eagle3_draft(tmp_path / "eagle3", target_path=target, seed=3, include_embedding=False))
    taps = {"draft_tap_ids": [0, 2]} if len(files) == 2 else {}  # the block draft's own layers beside EAGLE-3's
    model = mlx_dspark.load(str(target), draft=",".join([*map(str, files), "mtp"]), **taps)
    assert len(loaded_heads(model)) == len(files) + 1
    cache = mlx_dspark.make_prompt_cache(model)
    options = {"max_tokens": 12, "max_draft_tokens": 3, "lookup": "off"}
    first_prompt = list(range(20, 60))
    first = mlx_dspark.generate(model, first_prompt, prompt_cache=cache, **options)
    second_prompt = first_prompt + first.tokens + [7, 8, 9]
    warm = mlx_dspark.generate(model, second_prompt, prompt_cache=cache, **options)
    cold = mlx_dspark.generate(model, second_prompt, **options)
    assert warm.cached_tokens >= len(first_prompt) and cold.cached_tokens == 0
    assert sorted(cache.chains) == [name for name in sorted(loaded_heads(model)) if name != "draft"]  # each chain's own
    assert warm.tokens == cold.tokens == mlx_dspark.generate(model, second_prompt, max_tokens=12, speculative=False).tokens
    assert warm.acceptance_lengths == cold.acceptance_lengths  # each head's proposals as cold, round by round
    if "dspark" in heads:  # a cache made without the block draft holds no context for it: every turn is cold
        bare = PromptCache(model.target)
        mlx_dspark.generate(model, first_prompt, prompt_cache=bare, **options)
        again = mlx_dspark.generate(model, second_prompt, prompt_cache=bare, **options)
        assert again.cached_tokens == 0 and again.tokens == cold.tokens


def test_the_servers_second_turn_with_mtp_reports_cached_tokens_and_the_cold_servers_reply(checkpoints):
    from mlx_dspark.serve.cache_pool import PromptCacheBudget
    from tests.test_server import running_server
    from tests.test_server_prompt_cache import DEFAULTS, two_turns

    target = checkpoints["mtp-mimo"][0]
    loader = lambda: mlx_dspark.load(str(target), draft="mtp")  # noqa: E731
    with running_server(loader, defaults=DEFAULTS) as warm:
        first, second = two_turns(warm)
    with running_server(loader, defaults=DEFAULTS, prompt_cache=PromptCacheBudget(0)) as cold:
        cold_first, cold_second = two_turns(cold)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
    assert cold_second["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    for reply, cold_reply in ((first, cold_first), (second, cold_second)):
        assert reply["choices"][0]["message"] == cold_reply["choices"][0]["message"]
        for key in ("speculative", "rounds", "accepted_tokens", "proposed_tokens"):
            assert reply["dspark"][key] == cold_reply["dspark"][key], key


@pytest.mark.parametrize("pair", ["mtp-mimo", "eagle3"])
def test_batched_rows_resume_their_chains_and_draft_as_cold_rows(pairs, pair, monkeypatch):
    """As the server's batch worker runs them (`--max-batch`): each row over its own prompt cache."""
    from mlx_dspark.engine.proposers.chain import ChainProposer
    from mlx_dspark.engine.options import GenerationOptions
    from tests.batch_helpers import drive_batch

    model = pairs[pair]
    drafted: list[list] = []

    def revise(self, proposal, *, position, num_tokens):  # records what each row's chain drafted, after what
        drafted[-1].append((tuple(self.tokens), tuple(proposal.tokens[0].tolist())))
        return proposal

    monkeypatch.setattr(ChainProposer, "revise", revise, raising=False)
    options = GenerationOptions(max_tokens=12, speculation=SpeculationOptions(max_draft_tokens=3, lookup="off"))
    prompts = [list(range(20, 60)), [9, 8, 7, 6, 5, 4, 3, 2, 1] * 4]
    caches = [mlx_dspark.make_prompt_cache(model) for _ in prompts]
    drafted.append([])
    first, *_ = drive_batch(model, [(p, options) for p in prompts], joins=[0, 1], caches=caches)
    second = [p + first[i] + [7, 8, 9] for i, p in enumerate(prompts)]
    drafted.append([])
    warm, *_ = drive_batch(model, [(p, options) for p in second], joins=[0, 1], caches=caches)
    assert all(c.cached_tokens >= len(p) for c, p in zip(caches, prompts))
    drafted.append([])
    cold, *_ = drive_batch(model, [(p, options) for p in second], joins=[0, 1])
    assert warm == cold
    assert all(warm[i] == mlx_dspark.generate(model, p, max_tokens=12, speculative=False).tokens for i, p in enumerate(second))
    assert drafted[1] and sorted(drafted[1]) == sorted(drafted[2])  # each row's chain drafted as a cold row's
