"""The tree node budget (issue 37): `tree_nodes="auto"` picks the chain, a tree or no draft from the cost curve
and the acceptance seen; `--tree-nodes` on the generate command line."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from mlx_dspark.bench.controlled_tree import RankedProposer
from mlx_dspark.cli.generate import app
from mlx_dspark.engine.costs.curve import CostCurve
from mlx_dspark.engine.tree.grow import Tree, grow_tree
from mlx_dspark.engine.tree.budget import AutoTree
from mlx_dspark.engine.tree.rounds import tree_steps
from tests.engine_helpers import greedy_reference, make_target

VOCAB, DEPTH, CAP = 8, 4, 12
PROMPT = [3, 14, 15, 9, 26, 5]


def marginal_tree(top1: float, top2: float) -> Tree:
    """The best-first tree of CAP nodes over DEPTH positions whose draft puts top1 on token 1, top2 on token 2."""
    rest = (1 - top1 - top2) / (VOCAB - 2)
    row = np.log(np.array([rest, top1, top2] + [rest] * (VOCAB - 3), dtype=np.float32))
    logprobs = mx.array(np.tile(row, (1, 1)))
    return grow_tree(lambda depth, parents, state: (logprobs, None), mx.array([0]), num_nodes=CAP, max_depth=DEPTH)


class Clock:
    """A stand-in for time.perf_counter that a drive advances by what each round took."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def drive(policy: AutoTree, tree: Tree, right: np.ndarray, rounds: int, *, round_ms=None, clock: Clock | None = None) -> None:
    """`rounds` rounds: the policy picks rows of `tree`; the target's token at each depth is right[round, depth].
    `round_ms(verified)`: what a round of those rows took, told to the policy and added to `clock` (parked rounds
    too); None: untimed."""
    for r in range(rounds):
        nodes = policy.grow_nodes(position=0, depth=DEPTH)
        if clock is not None:
            clock.now += (round_ms(tree.top_chain()[:nodes] if policy.chain_round else list(range(1, nodes + 1)))) / 1000
        if nodes == 0:
            policy.length_policy.observe(proposed=0, accepted=0)  # a parked step, as the parked steps tell it
            continue
        if policy.chain_round:  # the chain alone (the tree's top chain: its first rows)
            chain = tree.top_chain()[:nodes]
            accepted = next((k for k, row in enumerate(chain) if tree.tokens[row - 1] != right[r, k]), len(chain))
            policy.observe_chain(proposed=len(chain), accepted=accepted, ms=None if round_ms is None else round_ms(chain))
            continue
        verified = policy.pick(tree, position=0)
        held, path, row = set(verified), [], 0
        for depth in range(DEPTH):
            child = next((i + 1 for i, p in enumerate(tree.parents) if p == row and i + 1 in held and tree.tokens[i] == right[r, depth]), None)
            if child is None:
                break
            path.append(child)
            row = child
        policy.observe(tree, verified=verified, path=path, ms=None if round_ms is None else round_ms(verified))


def right_tokens(rng: np.random.Generator, top1: float, top2: float, rounds: int) -> np.ndarray:
    u = rng.random((rounds, DEPTH))
    return np.where(u < top1, 1, np.where(u < top1 + top2, 2, 5))


def steady_choices(policy: AutoTree) -> set[str]:
    """What the policy picks once it has seen the rounds (the whole-tree looks aside)."""
    return {name for name, n in policy.choices.items() if n > 4 and name != "look"}


def test_a_confident_draft_on_a_rising_cost_curve_picks_the_chain():
    curve = CostCurve(draft_ms=0.5, verify_ms=[1.0 + 0.02 * n for n in range(CAP + 1)])
    tree = marginal_tree(0.95, 0.03)
    policy = AutoTree(curve, CAP)
    drive(policy, tree, right_tokens(np.random.default_rng(0), 0.97, 0.02, 80), 80)
    assert steady_choices(policy) == {f"chain-{DEPTH}"}, policy.choices


def test_a_confident_draft_on_a_flat_curve_picks_the_chain_over_a_tree_of_the_same_value():
    tree = marginal_tree(0.95, 0.03)
    policy = AutoTree(CostCurve.flat(max_width=CAP + 1), CAP)
    right = np.ones((60, DEPTH), dtype=int)  # the top chain, always
    drive(policy, tree, right, 60)
    assert steady_choices(policy) == {f"chain-{DEPTH}"}, policy.choices


def test_an_uncertain_draft_with_a_cheap_wide_verify_picks_the_tree():
    curve = CostCurve(draft_ms=0.5, verify_ms=[1.0 + 0.01 * n for n in range(CAP + 1)])
    tree = marginal_tree(0.5, 0.4)
    policy = AutoTree(curve, CAP)
    drive(policy, tree, right_tokens(np.random.default_rng(1), 0.5, 0.4, 80), 80)
    steady = steady_choices(policy)
    assert steady and all(name.startswith("tree-") for name in steady), policy.choices
    assert sum(n for name, n in policy.choices.items() if name.startswith("chain")) <= 4, policy.choices


def test_where_width_costs_as_much_as_it_brings_the_policy_parks_and_never_looks():
    """verify(n) grows like n: not even a tree accepting every node could beat a plain step, so no look is spent."""
    curve = CostCurve(draft_ms=1.0, verify_ms=[1.0 + n for n in range(CAP + 1)])  # a forward of n costs ~n steps
    tree = marginal_tree(0.5, 0.4)
    policy = AutoTree(curve, CAP)
    drive(policy, tree, right_tokens(np.random.default_rng(2), 0.5, 0.4, 200), 200)
    assert policy.choices == {"parked": 200}, policy.choices


def test_where_a_tree_could_pay_but_does_not_the_looks_come_less_often():
    """A draft whose chain pays and whose siblings never hold the target's token, on a curve where width costs
    something (a tree accepting every node would still pay): the looks find the chain better and back off (the
    first round, then intervals doubling to `max_explore_every`)."""
    curve = CostCurve(draft_ms=0.5, verify_ms=[1.0 + 0.1 * n for n in range(CAP + 1)])
    tree = marginal_tree(0.6, 0.3)
    policy = AutoTree(curve, CAP, depth=DEPTH)
    right = right_tokens(np.random.default_rng(3), 0.7, 0.0, 300)  # the top token or none of the tree's
    drive(policy, tree, right, 300)
    assert 3 <= policy.choices["look"] <= 7, policy.choices  # 1, 9, 25, 57, 121, 185, 249 at most
    assert not any(name.startswith("tree") for name in policy.choices), policy.choices
    assert policy.choices[f"chain-{DEPTH}"] > 200, policy.choices


def test_auto_tree_rounds_on_a_target_stay_plain_decoding_and_use_trees_where_width_is_cheap():
    target = make_target("qwen3", vocab_size=96)
    reference = greedy_reference(target, PROMPT, 140)
    for curve, expect in ((CostCurve.flat(max_width=CAP + 1), "tree"), (CostCurve(draft_ms=1.0, verify_ms=[1.0 + n for n in range(CAP + 1)]), "parked")):
        proposer = RankedProposer(reference, prompt_len=len(PROMPT), vocab_size=96, top1=0.6, top2=0.85)
        policy = AutoTree(curve, CAP)
        tokens = []
        for step in tree_steps(target, proposer, PROMPT, num_nodes=CAP, max_depth=7, budget=policy):
            tokens.extend(step.tokens)
            if len(tokens) >= 120:
                break
        assert tokens[:120] == reference[:120]
        top = max(policy.choices, key=policy.choices.get)
        assert top.startswith(expect), policy.choices


runner = CliRunner()


def test_generate_takes_tree_nodes_as_typed(tiny_qwen3_pair):
    target, draft = tiny_qwen3_pair
    common = ["--model", str(target), "--draft", str(draft), "--prompt", "Hello there", "--max-tokens", "16", "--json"]
    plain = runner.invoke(app, [*common, "--no-draft"])
    results = {}
    for nodes in ("auto", "6"):
        result = runner.invoke(app, [*common, "--tree-nodes", nodes, "--lookup", "off"])
        assert result.exit_code == 0, result.output
        results[nodes] = json.loads(result.stdout.strip().splitlines()[-1])
    assert results["auto"]["tokens"] == results["6"]["tokens"] == json.loads(plain.stdout.strip().splitlines()[-1])["tokens"]
    assert results["6"]["acceptance_lengths"]
    sampled = runner.invoke(app, [*common, "--tree-nodes", "auto", "--lookup", "off", "--temp", "0.8", "--top-k", "20", "--seed", "3"])
    assert sampled.exit_code == 0, sampled.output


def test_generate_with_tree_nodes_and_penalties_runs_chain_rounds_and_says_why_once(tiny_qwen3_pair):
    target, draft = tiny_qwen3_pair
    common = ["--model", str(target), "--draft", str(draft), "--prompt", "Hello there", "--max-tokens", "16", "--json",
              "--repetition-penalty", "1.2"]  # fmt: skip
    plain = runner.invoke(app, [*common, "--no-draft"])
    result = runner.invoke(app, [*common, "--tree-nodes", "8"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["tokens"] == json.loads(plain.stdout.strip().splitlines()[-1])["tokens"]
    notes = [line for line in result.stderr.splitlines() if "chain rounds instead of tree rounds" in line]
    assert len(notes) == 1 and "penalties" in notes[0] and "lookup 'on'" in notes[0], result.stderr


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tree-nodes", "many", "--lookup", "off"], "--tree-nodes: tree_nodes must be 'auto' or an integer in [0, 64], got 'many'"),
        (["--tree-nodes", "65", "--lookup", "off"], "--tree-nodes: tree_nodes must be an integer in [0, 64]"),
    ],
)
def test_bad_tree_nodes_give_one_error_line_naming_the_flag(tiny_qwen3_pair, extra, message):
    target, draft = tiny_qwen3_pair
    result = runner.invoke(app, ["--model", str(target), "--draft", str(draft), "--prompt", "Hi", "--max-tokens", "4", *extra])
    assert result.exit_code != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr


def test_a_curve_measured_under_load_heals_from_the_rounds_times_and_the_policy_stops_parking(monkeypatch):
    """A first-use curve whose draft block looked 40 plain steps dear parks `auto`; the rounds' own times (the
    chain policy's probes, the parked plain steps) show a block of 0.2 ms, so the healed curve drafts."""
    from mlx_dspark.engine.policy import draft_length

    clock = Clock()
    monkeypatch.setattr(draft_length, "time", clock)
    tree = marginal_tree(0.9, 0.05)
    curve = CostCurve(draft_ms=40.0, verify_ms=[1.0 + 0.02 * n for n in range(CAP + 1)])
    healing, fixed = AutoTree(curve, CAP, depth=DEPTH, heal=True), AutoTree(curve, CAP, depth=DEPTH, heal=False)
    right = right_tokens(np.random.default_rng(0), 0.9, 0.05, 400)
    for policy in (healing, fixed):  # what a round really took: its verify, and a draft block of 0.2 ms
        drive(policy, tree, right, 400, clock=clock,
              round_ms=lambda verified: curve.verify_ms[len(verified)] + (0.2 if verified else 0.0))  # fmt: skip
    assert healing.curve.draft_ms < 1.0 and fixed.curve.draft_ms == 40.0
    assert healing.choices["parked"] < fixed.choices["parked"] / 4
    assert sum(n for name, n in healing.choices.items() if name.startswith(("chain", "tree"))) > 300
