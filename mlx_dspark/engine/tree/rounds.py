"""The tree round (issue 37): propose a token tree, verify it in one forward, commit the accepted path.

propose: the draft's per-position distributions (its Markov head's conditional logits per parent) grow
a tree of at most B nodes, the draft's top chain and the best-first others (tree.py; one host read) -> verify: [anchor, nodes] in one target
forward, each node at the anchor's position plus its depth, seeing the cache and its ancestors only
(models/target/tree_verify.py) -> accept: the longest path of nodes equal to the target's argmax at their
parent, or sampled, by recursive rejection over each node's children (tree_accept.py; the round's host
read) -> commit: the caches keep the anchor and that path's rows only, the draft context takes their
features -> the bonus is the next anchor.

How many nodes a round verifies is a budget policy's (tree_budget.py: a fixed count, or auto from this
machine's cost curve: the top chain or a tree, or no draft at all). Without logits processing or lookup:
a request with them runs chain rounds instead (steps.make_steps, tree_fallback.py). A proposer grows trees through
`tree_children(anchor, position=, depth=)`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator, Sequence

import mlx.core as mx

from mlx_dspark.engine.round.decode import Round, _check_cancel, _commit, _parked_round, prefill_cached, verify
from mlx_dspark.engine.round.parked import parked_steps
from mlx_dspark.engine.policy.draft_length import DraftLength
from mlx_dspark.engine.logits.processing import LogitsProcessor
from mlx_dspark.engine.options import PREFILL_STEP_SIZE
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.proposers.base import Proposer, round_inputs
from mlx_dspark.models.caches.kv import trim_caches
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.engine.tree.grow import Tree, grow_tree
from mlx_dspark.engine.tree.accept import accept_tree_greedy, accept_tree_sampled
from mlx_dspark.engine.tree.budget import FixedTree, TreeBudget
from mlx_dspark.models.target.tree_verify import keep_path, tree_problem, tree_target_forward


def tree_steps(
    target: Any,
    proposer: Proposer,
    prompt: Sequence[int],
    *,
    num_nodes: int,
    max_depth: int,
    sampler: Sampler = Sampler(),
    budget: TreeBudget | None = None,
    max_tokens: int | None = None,
    prefill_step_size: int = PREFILL_STEP_SIZE,
    prompt_cache: PromptCache | None = None,
    cancel: threading.Event | None = None,
) -> Iterator[Round]:
    """Lossless decoding (greedy, or sampled by `sampler`) with tree rounds: yields the prefill's token,
    then one Round per verify.

    Each round grows a tree of at most `num_nodes` nodes (or what `budget` asks), `max_depth` deep (or what
    `max_tokens` leaves), and verifies the rows `budget` picks (default: all of them); a Round's `proposed`
    counts the verified nodes, `accepted` the accepted path's length.
    """
    budget = FixedTree(num_nodes) if budget is None else budget
    prompt_cache = PromptCache(target, max_snapshots=0) if prompt_cache is None else prompt_cache
    problem = tree_problem(target, prompt_cache.target_cache)
    if problem is not None:
        raise ValueError(f"tree rounds: {problem}; use tree_nodes 0 (chain rounds)")
    tap_ids = tuple(proposer.tap_ids)
    logits = prefill_cached(
        target, prompt_cache, prompt, tap_ids=tap_ids, proposer=proposer, step_size=prefill_step_size, cancel=cancel
    )
    lease, cache = prompt_cache.lease, prompt_cache.target_cache
    processor = LogitsProcessor.passthrough()
    anchor = sampler.sample(logits).astype(mx.int32).reshape(1)
    anchor_id = int(anchor.item())
    position = len(prompt)  # the anchor's position; caches hold 0 .. position - 1
    emitted = 1
    _commit(processor, proposer, [anchor_id])
    yield Round(tokens=[anchor_id])
    def depth_at(emitted: int) -> int:
        return max_depth if max_tokens is None else max(0, min(max_depth, max_tokens - emitted - 1))

    asked = None  # nodes for the next round when a parked run already asked the budget
    while True:
        _check_cancel(cancel)
        prompt_cache.claim(lease)
        depth = depth_at(emitted)
        asked = budget.grow_nodes(position=position, depth=depth) if asked is None else asked
        if asked == 0 and depth:  # parked: plain decoding's own pipelined steps until the budget drafts again
            resume = yield from parked_steps(
                target, proposer, anchor=anchor, anchor_id=anchor_id, position=position, emitted=emitted, cache=cache,
                tap_ids=tap_ids, prompt_cache=prompt_cache, sampler=sampler, processor=processor,
                draft_length=_ParkedBudget(budget, lambda p: depth_at(p - position + emitted)),
                room=lambda e: depth_at(e), commit=lambda tokens: _commit(processor, proposer, tokens),
                round_of=_parked_round, check_cancel=lambda: _check_cancel(cancel),
            )  # fmt: skip
            anchor, anchor_id, position, emitted, asked = (resume.anchor, resume.anchor_id, resume.position,
                                                           resume.emitted, resume.length)  # fmt: skip
            continue
        start = time.perf_counter()
        nodes, asked = min(num_nodes, asked), None
        if budget.chain_round:  # the chain alone: the chain round's own propose and verify, no tree to grow or mask
            committed, features = _chain_round(target, cache, proposer, anchor, position, nodes if depth else 0, tap_ids, sampler)
            accepted = len(committed) - 1
            budget.observe_chain(proposed=nodes if depth else 0, accepted=accepted, ms=1000 * (time.perf_counter() - start))
            trim_caches(cache, (nodes if depth else 0) - accepted)
            rows = list(range(accepted + 1))
            proposed = nodes if depth else 0
        else:
            grown = Tree(tokens=[], parents=[], depths=[], path_probs=[])
            if depth and nodes:  # the draft's top chain as deep as the round goes, then the best other nodes
                grown = grow_tree(proposer.tree_children(anchor, position=position, depth=depth), anchor, num_nodes=nodes, max_depth=depth)
            verified = budget.pick(grown, position=position) if grown.size else []
            tree = grown.subtree(verified)
            committed, rows, features = _verify(target, cache, tree, anchor_id, position, tap_ids, sampler)
            ms = 1000 * (time.perf_counter() - start)  # to the round's host read: the draft, growth, verify
            budget.observe(grown, verified=verified, path=[verified[row - 1] for row in rows[1:]], ms=ms)
            accepted = len(committed) - 1
            keep_path(cache, width=tree.size + 1, rows=rows[1:])
            proposed = tree.size
        _commit(processor, proposer, committed)
        if features is not None:
            proposer.extend(features[:, mx.array(rows, dtype=mx.int32)])
        anchor = mx.array(committed[-1:], dtype=mx.int32)
        position += accepted + 1
        emitted += accepted + 1
        prompt_cache.record([anchor_id, *committed[:-1]])  # the bonus, the new anchor, is not in the caches
        anchor_id = committed[-1]
        yield Round(tokens=committed, proposed=proposed, accepted=accepted, verified=True, source="draft" if proposed else None)


class _ParkedBudget(DraftLength):
    """A tree budget asked as a length policy by the parked steps: drafting again when it grows nodes; the
    parked steps' times and counts go to the budget's own length policy (it times plain steps, probes)."""

    def __init__(self, budget: TreeBudget, depth_at: Any) -> None:
        self.budget, self.depth_at, self.cap = budget, depth_at, 0
        self.inner = budget.length_policy or DraftLength()

    def next_length(self, *, position: int) -> int:
        return self.budget.grow_nodes(position=position, depth=self.depth_at(position))

    def observe(self, *, proposed: int, accepted: int, confidence: Any = None) -> None:
        self.inner.observe(proposed=proposed, accepted=accepted, confidence=confidence)

    def restart_clock(self) -> None:
        self.inner.restart_clock()

    def untimed(self, ms: float) -> None:
        self.inner.untimed(ms)


def _chain_round(
    target: Any, cache: Any, proposer: Proposer, anchor: mx.array, position: int, num_tokens: int,
    tap_ids: tuple[int, ...], sampler: Sampler,
) -> tuple[list[int], mx.array | None]:  # fmt: skip
    """A chain round as decode.speculative_steps runs it: the proposer's block, one causal verify forward and
    its acceptance (the round's one host read) -> (committed tokens, the forward's features (1, 1 + l, F) or
    None); the caches still hold the rejected drafts."""
    draft_tokens, draft_probs = mx.zeros((0,), mx.int32), None
    if num_tokens:
        proposal = proposer.propose(anchor, position=position, num_tokens=num_tokens, **round_inputs(proposer, target_cache=cache))
        mx.async_eval(proposal.tokens)  # the draft on the device while the host builds the verify graph
        draft_tokens = proposal.tokens[0, :num_tokens].astype(mx.int32)
        draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[0, :num_tokens]
    acceptance, features, _ = verify(target, cache, anchor, draft_tokens, draft_probs, tap_ids=tap_ids, sampler=sampler,
                                     processor=LogitsProcessor.passthrough())  # fmt: skip
    accepted = int(acceptance.accepted.item())
    return acceptance.tokens[: accepted + 1].tolist(), features


def _verify(
    target: Any, cache: Any, tree: Tree, anchor_id: int, position: int, tap_ids: tuple[int, ...], sampler: Sampler
) -> tuple[list[int], list[int], mx.array | None]:
    """One forward over [anchor, nodes] and its acceptance -> (committed tokens, the accepted path's rows
    anchor first, the forward's features (1, 1 + B, F) or None)."""
    ancestors = tree.ancestors()
    logits, features = tree_target_forward(
        target, mx.array([anchor_id, *tree.tokens], dtype=mx.int32), cache,
        positions=tree.positions(position), ancestors=ancestors, tap_ids=tap_ids,
    )  # fmt: skip
    shape = dict(
        node_tokens=mx.array(tree.tokens, dtype=mx.int32), parents=mx.array(tree.parents, dtype=mx.int32),
        depths=mx.array(tree.depths, dtype=mx.int32), ancestors=ancestors, max_depth=tree.max_depth,
    )  # fmt: skip
    if sampler.greedy:
        acceptance = accept_tree_greedy(**shape, target_logits=logits.astype(mx.float32))
    else:
        acceptance = accept_tree_sampled(**shape, target_probs=sampler.probs(logits))
    mx.eval(acceptance.accepted, acceptance.rows, acceptance.tokens)  # the round's host read
    accepted = int(acceptance.accepted.item())
    return acceptance.tokens[: accepted + 1].tolist(), acceptance.rows[: accepted + 1].tolist(), features
