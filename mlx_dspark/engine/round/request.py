"""Which step generator a request runs, built from its options: plain or speculative, and its logits processing.

`api.stream_generate` calls `compile_request` first (a bad constraint fails before any model work), then
`make_steps` when the stream starts.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Iterator

from mlx_dspark.engine.policy.proposal_choice import Chooser, RoundCost
from mlx_dspark.engine.logits.constraints import compile_constraint
from mlx_dspark.engine.costs.probe import cost_curve_for
from mlx_dspark.engine.round.decode import Round, plain_steps, speculative_steps
from mlx_dspark.engine.policy.draft_length import AUTO, make_draft_length
from mlx_dspark.engine.policy.head_choice import HeadChoice
from mlx_dspark.engine.logits.grammar import GrammarState
from mlx_dspark.engine.proposers.lookup import LOOKUP_MAX_TOKENS
from mlx_dspark.engine.logits.processing import LogitsProcessor
from mlx_dspark.engine.options import MAX_TREE_NODES, GenerationOptions
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.proposers import cost_kind, default_head, head_block, loaded_heads, make_head_proposer
from mlx_dspark.engine.proposers.base import BLOCK, CHAIN, Proposer
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.costs.curve import require_confidence_head
from mlx_dspark.engine.tree.budget import AutoTree, FixedTree
from mlx_dspark.engine.tree.fallback import draft_reason, option_reasons, say_chain_rounds
from mlx_dspark.engine.tree.rounds import tree_steps
from mlx_dspark.models.target.tree_verify import tree_problem


def compile_request(model: Any, options: GenerationOptions) -> GrammarState | None:
    """The request's grammar state, compiled against the model's tokenizer (ConstraintError if refused)."""
    if options.constraint is None:
        return None
    return compile_constraint(options.constraint, model.tokenizer, model.target.args.vocab_size)


def make_processor(
    model: Any, prompt_ids: list[int], options: GenerationOptions, grammar: GrammarState | None
) -> LogitsProcessor | None:
    sampling = options.sampling
    if grammar is None and not sampling.logit_bias and not sampling.has_penalties and options.logprobs is None:
        return None
    return LogitsProcessor(
        vocab_size=model.target.args.vocab_size,
        history=prompt_ids,
        sampling=sampling,
        grammar=grammar,
        mask_draft=options.speculation.mask_draft,
        logprobs=options.logprobs,
    )


def make_steps(
    model: Any,
    prompt_ids: list[int],
    options: GenerationOptions,
    proposer: Proposer | None,
    prompt_cache: PromptCache | None,
    cancel: threading.Event | None,
    grammar: GrammarState | None = None,
) -> Iterator[Round]:
    """The step generator for one request; `grammar` from `compile_request` (fresh per request)."""
    vocab = model.target.args.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
    sampling, speculation = options.sampling, options.speculation
    step_size = options.prefill_step_size
    processor = make_processor(model, prompt_ids, options, grammar)
    if not speculation.speculative:
        return plain_steps(model.target, prompt_ids, sampler=sampling, prompt_cache=prompt_cache,
                           prefill_step_size=step_size, cancel=cancel, processor=processor)
    if speculation.tree_nodes:
        trees = _tree_rounds(model, prompt_ids, options, proposer, prompt_cache, cancel)
        if trees is not None:
            return trees
        # chain rounds with every feature intact (the reason said once, tree_fallback.py)
        speculation = dataclasses.replace(speculation, tree_nodes=0)
        options = dataclasses.replace(options, speculation=speculation)
    lookup = speculation.lookup
    if lookup != "off" and prompt_cache is None:
        # caches that roll back a whole lookup block (rejected tokens of a LOOKUP_MAX_TOKENS block)
        prompt_cache = PromptCache(model.target, max_snapshots=0, max_rollback=LOOKUP_MAX_TOKENS)
    draft_length = None
    if proposer is None and len(loaded_heads(model)) > 1 and lookup != "only":
        # several heads: the round takes the one that pays (head_choice.py), each head over the prompt cache's state
        if prompt_cache is None:
            prompt_cache = PromptCache(model.target, model.draft, max_snapshots=0, max_rollback=LOOKUP_MAX_TOKENS)
        proposer, draft_length, speculation = _head_choice(model, prompt_ids, options, prompt_cache)
    if proposer is None and loaded_heads(model) and lookup != "only":
        proposer = head_proposer(model, default_head(model), prompt_ids, options, prompt_cache)
    if speculation.confidence_threshold > 0 and isinstance(proposer, DraftProposer):
        # as llama-server refuses --spec-draft-p-min > 0 for a DSpark draft without a confidence head
        require_confidence_head(
            proposer.draft, source=getattr(model, "draft_path", None) or "the draft",
            need=f"confidence_threshold {speculation.confidence_threshold}", fix="set it to 0",
        )  # fmt: skip
    if speculation.verify_schedule == "confidence":
        if isinstance(proposer, DraftProposer):
            require_confidence_head(proposer.draft, source=getattr(model, "draft_path", None) or "the draft")
        if proposer is None:  # the schedule sizes draft blocks: without a draft there is nothing to size
            speculation = dataclasses.replace(speculation, verify_schedule="fixed")
    drafting = proposer is not None or lookup != "off" or (grammar is not None and speculation.fast_forward)
    if drafting and (speculation.verify_schedule == "confidence" or speculation.auto_length) and speculation.cost_curve is None:
        # this machine's curve for the pair, measured once and cached on disk
        curve = cost_curve_for(model)
        if cost_kind(default_head(model)) == CHAIN:  # a chain's cost is measured, not healed (as in _head_choice)
            curve = dataclasses.replace(curve, cache_path=None)
        speculation = dataclasses.replace(speculation, cost_curve=curve)
    proposer = _chosen(proposer, prompt_ids, speculation, grammar)
    if proposer is None:
        return plain_steps(model.target, prompt_ids, sampler=sampling, prompt_cache=prompt_cache,
                           prefill_step_size=step_size, cancel=cancel, processor=processor)
    if draft_length is None:  # built here, not in the round, so it hears when the generation ends (_flushed)
        draft_length = make_draft_length(
            speculation.max_draft_tokens, speculation.draft_length(int(proposer.block_size)), speculation.cost_curve
        )
    return _flushed(proposer, speculative_steps(
        model.target,
        proposer,
        prompt_ids,
        sampler=sampling,
        speculation=speculation,
        max_tokens=options.max_tokens,
        prompt_cache=prompt_cache,
        prefill_step_size=step_size,
        cancel=cancel,
        processor=processor,
        draft_length=draft_length,
    ), policy=draft_length)


def _tree_rounds(
    model: Any, prompt_ids: list[int], options: GenerationOptions, proposer: Proposer | None,
    prompt_cache: PromptCache | None, cancel: threading.Event | None,
) -> Iterator[Round] | None:  # fmt: skip
    """Tree rounds (tree_steps.py) with the pair's DSpark draft, or a given proposer that grows trees; `tree_nodes`
    "auto" sizes each round on this machine's cost curve (tree_budget.AutoTree), widths 1.. the curve's. None
    (and the reason said once) where the request, the draft or the target's caches cannot run them."""
    speculation = options.speculation
    reasons = option_reasons(options)
    draft = draft_reason(model, proposer)
    reasons += [] if draft is None else [draft]
    caches = prompt_cache.target_cache if prompt_cache is not None else model.target.make_cache()
    target = tree_problem(model.target, caches)
    reasons += [] if target is None else [target]
    if reasons:
        say_chain_rounds(speculation.tree_nodes, reasons)
        return None
    if proposer is None:
        proposer = DraftProposer(  # its chain rounds draft as the request samples (a tree's growth reads log-probabilities)
            model.draft, model.target, greedy=options.sampling.greedy, temperature=options.sampling.temperature or 1.0,
            context=None if prompt_cache is None else prompt_cache.draft_context,
        )  # fmt: skip
    if speculation.tree_nodes == AUTO:
        depth, curve = speculation.draft_length(int(proposer.block_size)), speculation.cost_curve or cost_curve_for(model)
        # the chain rounds' own length policy (auto, or the fixed cap asked), with trees where they pay
        chain = make_draft_length(speculation.max_draft_tokens, depth, curve)
        budget = AutoTree(curve, MAX_TREE_NODES, depth=depth, chain=chain)
    else:
        budget = FixedTree(speculation.tree_nodes)
    return _flushed(proposer, tree_steps(
        model.target, proposer, prompt_ids, num_nodes=MAX_TREE_NODES, budget=budget, sampler=options.sampling,
        max_depth=speculation.draft_length(int(proposer.block_size)), max_tokens=options.max_tokens,
        prefill_step_size=options.prefill_step_size, prompt_cache=prompt_cache, cancel=cancel,
    ))  # fmt: skip


def _head_choice(model: Any, prompt_ids: list[int], options: GenerationOptions,
                 prompt_cache: PromptCache) -> tuple[HeadChoice, Any, Any]:  # fmt: skip
    """The pair's heads (engine/proposers: found by name), each with its own
    length policy over its own measured costs (cost_probe: a block draft's forward, a chain's cost per
    draft), each over `prompt_cache`'s state for it; (proposer, policy, the speculation options with the
    first head's curve for the lookup choice)."""
    sampling, speculation = options.sampling, options.speculation
    if speculation.verify_schedule == "confidence" or speculation.confidence_threshold > 0:
        raise ValueError("verify_schedule 'confidence' and confidence_threshold need one draft with a confidence head; "
                         "with several heads use the defaults")  # fmt: skip
    names = loaded_heads(model)
    heads = {name: head_proposer(model, name, prompt_ids, options, prompt_cache) for name in names}
    curves = {}
    for name in names:
        given = speculation.cost_curve if name == names[0] else None  # --cost-curve-file: the first head's
        curve = given or cost_curve_for(model, head=name)
        # a chain's cost is measured, not healed (the healer's round model is a block draft's)
        curves[name] = curve if cost_kind(name) == BLOCK else dataclasses.replace(curve, cache_path=None)
    policies = {name: make_draft_length(speculation.max_draft_tokens, speculation.draft_length(int(head.block_size)), curves[name])
                for name, head in heads.items()}  # fmt: skip
    choice = HeadChoice(heads, policies, curves)
    return choice, choice, dataclasses.replace(speculation, cost_curve=curves[names[0]])


def head_proposer(model: Any, name: str, prompt_ids: list[int], options: GenerationOptions,
                  prompt_cache: PromptCache | None = None) -> Proposer:  # fmt: skip
    """One loaded head's proposer (engine/proposers: found by its name), over the prompt cache's state for it
    when given (a later turn resumes it). A chain drafts its default steps per round unless a fixed length asks
    more; a block draft's block is its own."""
    sampling, speculation = options.sampling, options.speculation
    fixed = speculation.max_draft_tokens if isinstance(speculation.max_draft_tokens, int) else None
    block = max(head_block(model, name), fixed or 0) if cost_kind(name) == CHAIN else None
    return make_head_proposer(
        model, name, prompt=prompt_ids, greedy=speculation.draft_sampling == "greedy" or sampling.greedy,
        temperature=max(sampling.temperature, 1e-6), block_size=block, prompt_cache=prompt_cache,
    )  # fmt: skip


def _flushed(proposer: Proposer, steps: Iterator[Round], *, policy: Any = None) -> Iterator[Round]:
    """The steps; when they end (stopped, cancelled, closed), the draft context takes the positions its
    proposer batches (propose.DraftProposer.extend), so a prompt cache holding it stays whole, and the
    length policy keeps what the rounds showed for the next generation (draft_length.AutoLength.finish)."""
    try:
        yield from steps
    finally:
        proposer.flush()
        if policy is not None:
            policy.finish()


def _chosen(draft: Proposer | None, prompt_ids: list[int], speculation: Any, grammar: GrammarState | None) -> Proposer | None:
    """The draft alone, or a Chooser (choose.py) when lookup is on or a grammar's forced runs can be verified."""
    forced = grammar if grammar is not None and speculation.fast_forward else None
    if speculation.lookup == "off" and forced is None:
        return draft
    if speculation.lookup == "only":
        draft = None
    curve = speculation.cost_curve
    return Chooser.build(
        draft=draft, context=prompt_ids, lookup=speculation.lookup != "off", grammar=forced,
        cost=None if curve is None else RoundCost.from_curve(curve),
    )  # fmt: skip
