"""Tree rounds (issue 37): lossless, caches as plain decoding leaves them, the best-first tree, the refusals."""

from __future__ import annotations

import itertools
import math
import warnings
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_dspark.bench.controlled_tree import RankedProposer
from mlx_dspark.engine.options import GenerationOptions, OptionError, SamplingOptions, SpeculationOptions
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.round.request import make_steps
from mlx_dspark.engine.tree.grow import Tree, grow_tree
from mlx_dspark.engine.tree.accept import accept_tree_greedy
from mlx_dspark.engine.tree.rounds import tree_steps
from mlx_dspark.engine.tree.budget import TreeBudget
from tests.engine_helpers import greedy_reference, make_draft, make_target

PROMPT = [3, 14, 15, 9, 26, 5]
VOCAB = 96


@pytest.fixture(scope="module")
def qwen3():
    target = make_target("qwen3", vocab_size=VOCAB)
    return target, greedy_reference(target, PROMPT, 240)


def test_tree_rounds_are_plain_decoding_and_accept_off_the_top_chain_in_most_rounds(qwen3):
    target, reference = qwen3
    proposer = RankedProposer(reference, prompt_len=len(PROMPT), vocab_size=VOCAB, top1=0.6, top2=0.85)
    tokens, rounds, off_chain, accepted = [], 0, 0, 0
    position = len(PROMPT)  # the anchor's
    for step in tree_steps(target, proposer, PROMPT, num_nodes=16, max_depth=7):
        if step.verified:
            rounds += 1
            accepted += step.accepted
            # the accepted path left the top chain where one of its nodes was not its depth's top-1 token
            off_chain += any(proposer.rank(position + d) != 1 for d in range(1, step.accepted + 1))
            position += len(step.tokens)
        tokens.extend(step.tokens)
        if len(tokens) >= 220:
            break
    assert tokens[:220] == reference[:220]
    assert off_chain > rounds / 2, f"the accepted path left the top chain in {off_chain} of {rounds} rounds"
    # a top-1 chain accepts ~0.6 / 0.4 = 1.5 per round at this accuracy; the tree more
    assert accepted / rounds > 2.0


def _kv_rows(caches):
    return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]


def test_after_each_tree_round_every_cache_holds_what_a_cold_prefill_of_the_committed_tokens_leaves(qwen3):
    target, reference = qwen3
    proposer = RankedProposer(reference, prompt_len=len(PROMPT), vocab_size=VOCAB, top1=0.6, top2=0.85)
    prompt_cache = PromptCache(target, max_snapshots=0)
    committed: list[int] = []
    rounds = 0
    for step in tree_steps(target, proposer, PROMPT, num_nodes=12, max_depth=7, prompt_cache=prompt_cache):
        committed.extend(step.tokens)
        caches = prompt_cache.target_cache
        held = PROMPT + committed[:-1]  # the newest token is the next anchor, not in the caches yet
        assert all(c.offset == len(held) for c in caches)
        cold = target.make_cache()
        target(mx.array(held)[None], cache=cold)
        for (keys, values), (cold_keys, cold_values) in zip(_kv_rows(caches), _kv_rows(cold)):
            assert keys.shape == cold_keys.shape
            assert mx.allclose(keys, cold_keys, atol=1e-4).item() and mx.allclose(values, cold_values, atol=1e-4).item()
        rounds += step.verified
        if len(committed) >= 60:
            break
    assert rounds >= 15


def _table_children(table):
    """children from a table of conditional log-probabilities: table[depth - 1][parent token] (V,)."""

    def children(depth, parents, state):
        return table[depth - 1][parents], None

    return children


def _greedy_chain(table, anchor, depth):
    parent, chain = anchor, []
    for d in range(depth):  # the greedy chain, step by step on the table
        parent = int(mx.argmax(table[d][parent]).item())
        chain.append(parent)
    return tuple(chain)


def test_grow_tree_takes_the_top_chain_then_the_most_probable_paths_each_after_its_parent():
    vocab, depth, nodes = 4, 3, 9
    mx.random.seed(3)
    table = [mx.log(mx.softmax(2 * mx.random.normal((vocab, vocab)), axis=-1)) for _ in range(depth)]
    tree = grow_tree(_table_children(table), mx.array([1]), num_nodes=nodes, max_depth=depth)
    # brute force: every path of length 1..depth after the anchor 1, by its probability
    paths = {}
    for length in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=length):
            logprob, parent = 0.0, 1
            for d, token in enumerate(path):
                logprob += table[d][parent][token].item()
                parent = token
            paths[path] = math.exp(logprob)
    chain = _greedy_chain(table, 1, depth)
    chain_paths = [chain[:k] for k in range(1, depth + 1)]
    best = [paths[p] for p in chain_paths] + sorted((v for p, v in paths.items() if p not in chain_paths), reverse=True)[: nodes - depth]
    assert tree.size == nodes
    assert tree.path_probs == pytest.approx(best, rel=1e-5)  # the chain in rows 1..depth, then best-first
    assert [tree.tokens[row - 1] for row in tree.top_chain()] == list(chain)
    for i, (parent, node_depth) in enumerate(zip(tree.parents, tree.depths)):
        assert parent < i + 1 and node_depth == (1 if parent == 0 else tree.depths[parent - 1] + 1)


@pytest.mark.parametrize("nodes", [4, 6, 15])
def test_a_tree_of_a_flat_draft_holds_the_greedy_chain_as_deep_as_its_nodes_allow(nodes):
    vocab, depth = 6, 4
    mx.random.seed(4)
    table = [mx.log(mx.softmax(0.3 * mx.random.normal((vocab, vocab)), axis=-1)) for _ in range(depth)]  # flat: wide trees
    tree = grow_tree(_table_children(table), mx.array([1]), num_nodes=nodes, max_depth=depth)
    chain = _greedy_chain(table, 1, depth)[: min(nodes, depth)]
    assert tree.size == nodes
    assert tuple(tree.tokens[row - 1] for row in tree.top_chain())[: len(chain)] == chain
    assert tree.top_chain()[: len(chain)] == list(range(1, len(chain) + 1))  # its first rows


def test_tree_acceptance_commits_the_path_the_target_agrees_with():
    # anchor -> a(5) -> c(7); anchor -> b(6) -> d(8) -> e(9); the target's argmax: anchor 6, b 8, d 2
    tree = Tree(tokens=[5, 6, 7, 8, 9], parents=[0, 0, 1, 2, 4], depths=[1, 1, 2, 2, 3], path_probs=[0.5, 0.3, 0.2, 0.1, 0.05])
    argmax = [6, 0, 8, 0, 2, 0]  # per row: anchor, a, b, c, d, e
    logits = mx.zeros((6, 10)) + mx.eye(10)[mx.array(argmax)]
    acceptance = accept_tree_greedy(
        node_tokens=mx.array(tree.tokens), parents=mx.array(tree.parents), depths=mx.array(tree.depths),
        ancestors=tree.ancestors(), target_logits=logits, max_depth=tree.max_depth,
    )  # fmt: skip
    accepted = acceptance.accepted.item()
    assert accepted == 2
    assert acceptance.rows[: accepted + 1].tolist() == [0, 2, 4]
    assert acceptance.tokens[: accepted + 1].tolist() == [6, 8, 2]  # b, d, then the bonus at d


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_a_dspark_drafts_tree_children_are_its_markov_heads_conditional_logits(qwen3, head):
    target, _ = qwen3
    draft = make_draft(target, markov_head_type=head, layers=1)
    proposer = DraftProposer(draft, target, greedy=True, temperature=1.0)
    cache = target.make_cache()
    _, features = target(mx.array(PROMPT)[None], cache=cache, tap_ids=proposer.tap_ids)
    proposer.extend(features)
    anchor = mx.array([7], dtype=mx.int32)
    chain = proposer.propose(anchor, position=len(PROMPT), num_tokens=4)
    children = proposer.tree_children(anchor, position=len(PROMPT), depth=4)
    parent, state = anchor, None
    for k in range(4):  # along the greedy chain, each node's children are the chain's next distribution
        logprobs, state = children(k + 1, parent, state)
        assert mx.argmax(logprobs[0]).item() == chain.tokens[0, k].item()
        assert math.exp(mx.max(logprobs[0]).item()) == pytest.approx(chain.token_probs[0, k].item(), rel=1e-4)
        parent = chain.tokens[0, k : k + 1]
    tree = grow_tree(proposer.tree_children(anchor, position=len(PROMPT), depth=4), anchor, num_nodes=8, max_depth=4)
    top = [tree.tokens[row - 1] for row in tree.top_chain()]
    assert top == chain.tokens[0, : len(top)].tolist()


def test_a_dspark_draft_in_tree_rounds_through_make_steps_is_plain_decoding(qwen3):
    target, reference = qwen3
    draft = make_draft(target, layers=1)
    model = SimpleNamespace(target=target, draft=draft, heads={"draft": draft})
    options = GenerationOptions(max_tokens=60, speculation=SpeculationOptions(tree_nodes=8, lookup="off"))
    tokens, rounds = [], 0
    for step in make_steps(model, PROMPT, options, None, None, None):
        tokens.extend(step.tokens)
        rounds += step.verified
        if len(tokens) >= 60:
            break
    assert tokens[:60] == reference[:60]
    assert rounds >= 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: SpeculationOptions(tree_nodes=-1, lookup="off"),
        lambda: SpeculationOptions(tree_nodes=65, lookup="off"),
        lambda: SpeculationOptions(tree_nodes=True, lookup="off"),
        lambda: SpeculationOptions(tree_nodes="often", lookup="off"),
    ],
)
def test_a_bad_tree_nodes_value_is_refused_with_an_option_error_naming_it(make):
    with pytest.raises(OptionError) as raised:
        make()
    assert raised.value.field == "tree_nodes"


@pytest.fixture(scope="module")
def loaded_pair(tiny_qwen3_pair):
    import mlx_dspark

    return mlx_dspark.load(str(tiny_qwen3_pair[0]), draft=str(tiny_qwen3_pair[1]))


def fallback_notes(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "chain rounds instead of tree rounds" in str(w.message)]


def chain_tokens(model, options: GenerationOptions, count: int) -> tuple[list[int], list[str]]:
    """make_steps' first `count` tokens and the fallback notes it gave."""
    tokens = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in make_steps(model, PROMPT, options, None, None, None):
            tokens.extend(step.tokens)
            if len(tokens) >= count:
                break
    return tokens[:count], fallback_notes(caught)


def test_a_target_with_sliding_window_caches_is_refused_by_tree_steps():
    target = make_target("spark2_5", vocab_size=VOCAB, layers=2)
    proposer = RankedProposer([1] * 40, prompt_len=len(PROMPT), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="attention-only full-KV targets first"):
        next(tree_steps(target, proposer, PROMPT, num_nodes=8, max_depth=4))


def test_a_sliding_window_target_asked_for_trees_runs_chain_rounds_as_plain_decoding_and_says_so_once():
    target = make_target("spark2_5", vocab_size=VOCAB, layers=2)
    draft = make_draft(target, layers=1)
    model = SimpleNamespace(target=target, draft=draft, heads={"draft": draft})
    # a fixed chain length: the SimpleNamespace pair has no cost curve to measure
    options = GenerationOptions(max_tokens=40, speculation=SpeculationOptions(tree_nodes=8, lookup="off", max_draft_tokens=4))
    tokens, notes = chain_tokens(model, options, 40)
    assert tokens == greedy_reference(target, PROMPT, 40)
    assert len(notes) == 1 and "attention-only full-KV targets first" in notes[0], notes


def test_a_dflash2_draft_asked_for_trees_runs_chain_rounds_as_plain_decoding_and_says_so_once(qwen3):
    target, reference = qwen3
    draft = make_draft(target, layers=1, dflash2=dict(conv_kernel_size=2, conv_group_size=16, selector_rank=4, selector_top_k=4))
    model = SimpleNamespace(target=target, draft=draft, heads={"draft": draft})
    # a fixed chain length: the SimpleNamespace pair has no cost curve to measure
    options = GenerationOptions(max_tokens=40, speculation=SpeculationOptions(tree_nodes=8, lookup="off", max_draft_tokens=4))
    tokens, notes = chain_tokens(model, options, 40)
    assert tokens == reference[:40]
    assert len(notes) == 1 and "DFlash2" in notes[0], notes


@pytest.mark.parametrize(
    "keywords, named",
    [
        (dict(), "lookup 'on'"),  # lookup is on by default
        (dict(lookup="off", p_min=0.1), "p_min"),
        (dict(lookup="off", repetition_penalty=1.3), "penalties"),
        (dict(lookup="off", logprobs=2), "logprobs"),
        (dict(lookup="off", logit_bias={7: 2.0}, temperature=0.0), "logit_bias"),
        (dict(lookup="off", regex="[a-e ]{1,30}"), "a constraint"),
    ],
)
def test_a_request_trees_cannot_run_gets_chain_rounds_equal_to_plain_decoding_and_one_note(loaded_pair, keywords, named):
    import mlx_dspark
    from mlx_dspark.engine.logits.constraints import Constraint

    pair = loaded_pair
    keywords = dict(keywords)
    if "regex" in keywords:
        keywords["constraint"] = Constraint.regex(keywords.pop("regex"))
    prompt = list(range(5, 25))
    plain = mlx_dspark.generate(pair, prompt, max_tokens=24, speculative=False, **keywords)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tree = mlx_dspark.generate(pair, prompt, max_tokens=24, tree_nodes=8, **keywords)
    notes = fallback_notes(caught)
    assert tree.tokens == plain.tokens
    assert tree.logprobs == plain.logprobs
    assert len(notes) == 1 and named in notes[0] and notes[0].startswith("tree_nodes 8: "), notes


def test_generate_with_tree_nodes_and_a_prompt_cache_is_plain_decoding_over_two_turns(tiny_qwen3_pair):
    import mlx_dspark

    pair = mlx_dspark.load(str(tiny_qwen3_pair[0]), draft=str(tiny_qwen3_pair[1]))
    first = list(range(5, 25))
    plain = mlx_dspark.generate(pair, first, max_tokens=40, speculative=False)
    cache = mlx_dspark.make_prompt_cache(pair)
    tree = mlx_dspark.generate(pair, first, max_tokens=40, tree_nodes=12, lookup="off", prompt_cache=cache)
    assert tree.tokens == plain.tokens
    second = first + list(tree.tokens) + [7, 8, 9]
    plain = mlx_dspark.generate(pair, second, max_tokens=30, speculative=False)
    tree = mlx_dspark.generate(pair, second, max_tokens=30, tree_nodes=12, lookup="off", prompt_cache=cache)
    assert tree.tokens == plain.tokens
    assert tree.cached_tokens > 0


class _FlatRankedProposer(RankedProposer):
    """A draft right at rank 1 most of the time whose softmax is flat (under-confident): best-first growth by path
    probability alone spends the nodes on siblings and drops the chain's deep nodes (issue 52)."""

    def tree_children(self, anchor, *, position, depth):
        mass = [0.3, 0.25, 0.2]
        rest = math.log(0.25 / (self.vocab_size - 3))
        logprobs = mx.full((depth, self.vocab_size), rest, dtype=mx.float32)
        for k in range(depth):
            logprobs[k, mx.array(self.ranked(position + k + 1))] = mx.log(mx.array(mass))
        return lambda d, parents, state: (logprobs[d - 1][None], None)


def _forwards(steps, limit):
    tokens, forwards = [], 0
    for step in steps:
        tokens.extend(step.tokens)
        forwards += 1  # the prefill, then one verify per round
        if len(tokens) >= limit:
            return tokens[:limit], forwards


@pytest.mark.parametrize("nodes", [8, 15, 31])
def test_a_tree_never_needs_more_target_forwards_than_the_chain_at_equal_depth_on_the_same_text(qwen3, nodes):
    from mlx_dspark.engine.logits.sample import Sampler
    from mlx_dspark.engine.round.decode import speculative_steps

    target, reference = qwen3
    depth, limit = 7, 200
    proposer = lambda: _FlatRankedProposer(reference, prompt_len=len(PROMPT), vocab_size=VOCAB, top1=0.8, top2=0.9)  # noqa: E731
    chain, chain_forwards = _forwards(speculative_steps(
        target, proposer(), PROMPT, sampler=Sampler(), speculation=SpeculationOptions(max_draft_tokens=depth, lookup="off"),
    ), limit)  # fmt: skip
    tree, tree_forwards = _forwards(tree_steps(target, proposer(), PROMPT, num_nodes=nodes, max_depth=depth), limit)
    assert chain == tree == reference[:limit]
    assert tree_forwards <= chain_forwards, (tree_forwards, chain_forwards)


class _ParksThenDrafts(TreeBudget):
    """A tree budget that parks in rounds [10, 60) of the positions after the prompt, else verifies 8 nodes."""

    def __init__(self, prompt_len):
        self.prompt_len, self.asked = prompt_len, []

    def grow_nodes(self, *, position, depth=None):
        self.asked.append(position)
        return 0 if 10 <= position - self.prompt_len < 60 else 8

    def pick(self, tree, *, position):
        return list(range(1, tree.size + 1))

    def observe(self, tree, *, verified, path, ms=None):
        pass


def test_a_parked_tree_budget_runs_plain_decodings_pipelined_steps_and_drafts_again(qwen3, monkeypatch):
    """While the budget parks, tree rounds hand over to round/parked.parked_steps (the next forward queued
    before the last is read), asking the budget before each token; the output stays plain decoding's."""
    from mlx_dspark.engine.tree import rounds as tree_rounds

    target, reference = qwen3
    proposer = RankedProposer(reference, prompt_len=len(PROMPT), vocab_size=VOCAB, top1=0.6, top2=0.85)
    calls = []
    original = tree_rounds.parked_steps
    monkeypatch.setattr(tree_rounds, "parked_steps", lambda *a, **k: (calls.append(k["position"]), (yield from original(*a, **k)))[1])
    budget = _ParksThenDrafts(len(PROMPT))
    tokens, drafted_after = [], 0
    for step in tree_steps(target, proposer, PROMPT, num_nodes=8, max_depth=7, budget=budget, max_tokens=120):
        tokens.extend(step.tokens)
        drafted_after += step.proposed > 0 and len(tokens) > 60
        if len(tokens) >= 120:  # the generator runs on (rounds of the anchor alone): the caller stops it
            break
    assert tokens == reference[: len(tokens)] and len(tokens) >= 120
    assert len(calls) == 1  # one parked run, every parked position inside it
    assert set(range(len(PROMPT) + 11, len(PROMPT) + 60)) <= set(budget.asked)  # asked before each parked token
    assert drafted_after > 0  # it drafts again once the budget grows nodes
