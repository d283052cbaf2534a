"""Engine measurements at a controlled acceptance length (benchmark-only; never model acceptance).

Random-weight pairs accept almost nothing, so the speed of the round at a realistic acceptance is
measured with `ControlledProposer`: it runs the real draft forward every round (its cost is paid:
the proposed tokens depend on the draft's output in the graph) but proposes the target's own greedy
continuation, corrupted at one position per round so the acceptance lengths follow a deterministic
schedule with the chosen mean. Engine efficiency = measured speedup / ideal speedup, where the ideal
is `tau * t_decode / (t_draft + t_verify(block + 1))`. All three times are measured interleaved with the
runs (a `CostProbe` at the runs' mean context times a draft block and a verify forward between them;
`t_decode` is the interleaved plain runs' time per token), so load drifts on a shared machine hit
both sides; efficiency then equals ideal round time / measured round time and carries over to
other hardware.

A chained head (bench/controlled_chain.py) drafts `block` = k tokens
by k chained steps: `t_draft` is then its chain's time (first draft + k - 1 steps, `ChainProbe`),
reported with its cost per step.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import mlx.core as mx

from mlx_dspark.api import generate
from mlx_dspark.engine.round.decode import plain_steps
from mlx_dspark.engine.options import GenerationOptions
from mlx_dspark.engine.proposers.base import Proposal, Proposer
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.bench.controlled_chain import ChainProbe, chain_head, chain_proposer, chain_steps, step_ms
from mlx_dspark.bench.cost import CostProbe, ideal_speedup
from mlx_dspark.bench.profile import format_profile, profile_rounds
from mlx_dspark.bench.stats import loadavg, mean, median


class AcceptanceSchedule:
    """Acceptance lengths 1..block_size+1 whose running mean tracks `target` (error diffusion)."""

    def __init__(self, target: float, *, block_size: int) -> None:
        if not 1.0 <= target <= block_size + 1:
            raise ValueError(f"controlled acceptance length {target} must be in [1, {block_size + 1}] (block size {block_size})")
        self.target = target
        self.block_size = block_size
        self.total = 0
        self.rounds = 0

    def next(self) -> int:
        self.rounds += 1
        length = math.floor(self.target * self.rounds - self.total + 0.5)
        length = min(max(length, 1), self.block_size + 1)
        self.total += length
        return length


class ControlledProposer(Proposer):
    """The target's greedy continuation with one injected error per round, behind a real draft forward:
    a block draft's (DraftProposer) or a chained head's (bench/controlled_chain.py), `block_size` its drafts.

    A chained head's own cache pairs the target's features with the committed tokens (`commit`, passed on),
    never with the drafts it proposed: its chained entries are trimmed inside its `propose`, so replacing
    its tokens here leaves that cache as an uncontrolled run's."""

    def __init__(self, inner: Any, reference: Sequence[int], *, prompt_len: int, vocab_size: int, acceptance_length: float):
        self.inner = inner
        self.reference = list(reference)  # greedy tokens at positions prompt_len, prompt_len + 1, ...
        self.prompt_len = prompt_len
        self.vocab_size = vocab_size
        self.tap_ids = inner.tap_ids
        self.block_size = inner.block_size
        self.takes_target_cache = inner.takes_target_cache  # a Gemma 4 assistant reads them
        self.schedule = AcceptanceSchedule(acceptance_length, block_size=inner.block_size)

    def extend(self, features: mx.array) -> None:
        self.inner.extend(features)

    def commit(self, tokens: Sequence[int]) -> None:
        self.inner.commit(tokens)

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int, target_cache: Any = None) -> Proposal:
        extra = {} if target_cache is None else {"target_cache": target_cache}
        real = self.inner.propose(anchor, position=position, num_tokens=num_tokens, **extra)
        length = self.schedule.next()  # accepted = length - 1
        wrong = length - 1 if length <= num_tokens else None
        return Proposal(tokens=reference_block(real, self.reference, start=position - self.prompt_len + 1,
                                               num_tokens=num_tokens, wrong=wrong, vocab_size=self.vocab_size))  # fmt: skip


def reference_block(real: Proposal, reference: Sequence[int], *, start: int, num_tokens: int, wrong: int | None,
                    vocab_size: int) -> mx.array:
    """A controlled draft block (1, num_tokens): the reference continuation from index `start` (the token
    after the anchor; 0 past its end), its token at `wrong` (None: none) made wrong. `+ 0 * draft` keeps
    the real draft's forward (`real`) in the round's graph, so it is evaluated and paid."""
    tokens = list(reference[start : start + num_tokens])
    tokens += [0] * (num_tokens - len(tokens))
    if wrong is not None:
        tokens[wrong] = (tokens[wrong] + 1) % vocab_size
    return mx.array([tokens], dtype=mx.int32) + 0 * real.tokens[:, :num_tokens].astype(mx.int32)


def greedy_reference(target: Any, prompt: Sequence[int], length: int) -> list[int]:
    """The target's own greedy continuation (no stop tokens), by plain decoding."""
    out: list[int] = []
    for step in plain_steps(target, prompt, sampler=Sampler()):
        out.extend(step.tokens)
        if len(out) >= length:
            return out[:length]
    raise AssertionError("plain_steps never ends")


def tiled_prompt(ids: Sequence[int], length: int) -> list[int]:
    """`ids` repeated and cut to `length` tokens: a prompt of a chosen context length."""
    if not ids:
        raise ValueError("cannot build a prompt from no tokens")
    return [ids[i % len(ids)] for i in range(length)]


def run_controlled(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    acceptance_lengths: Sequence[float],
    max_tokens: int,
    repeats: int,
    probe_samples: int = 3,
) -> dict:
    """Interleaved plain and controlled-acceptance runs (greedy, stop tokens ignored by the caller's model).

    Returns per target acceptance length: measured tok/s and speedup over our plain decoding, the
    measured mean acceptance length, the ideal speedup from the cost curve, and the efficiency.
    """
    target, head = model.target, chain_head(model)
    context = len(prompts[0]) + max_tokens // 2
    if head is None:  # a block draft: one forward of `block` drafts
        block = int(model.draft.num_drafts)
        probe = CostProbe(model, context=context)
        pieces = {"draft": probe.draft_block}
    else:  # a chain: `block` chained steps, their cost per step from chains of `block` and of 1
        block = chain_steps(model, head, acceptance_lengths)
        probe = ChainProbe(model, head, steps=block, context=context)
        pieces = {"draft": probe.draft_block, "draft_first": probe.draft_first}
    pieces["verify"] = lambda: probe.verify(block + 1)

    def inner(ids: Sequence[int]) -> Any:
        if head is None:
            return DraftProposer(model.draft, target, greedy=True, temperature=1.0)
        return chain_proposer(model, head, ids, steps=block)

    for piece in pieces.values():
        piece()  # warm-up
    probe_ms: dict[str, list[float]] = {key: [] for name in pieces for key in (name, f"{name}_build")}
    references = [greedy_reference(target, ids, max_tokens + block + 1) for ids in prompts]
    plain_tps: list[float] = []
    by_tau: dict[float, dict[str, list]] = {tau: {"tps": [], "lengths": [], "match": []} for tau in acceptance_lengths}
    plain_options = GenerationOptions.from_keywords(max_tokens=max_tokens, speculative=False)
    # full blocks: the efficiency's ideal is a round of block + 1 verified tokens (auto is bench/draft_length_ab.py's);
    # lookup off: every round verifies the head's controlled block (a lookup block or tail would replace or extend it)
    controlled_options = GenerationOptions.from_keywords(max_tokens=max_tokens, max_draft_tokens=None, lookup="off")
    load_before = loadavg()
    for repeat in range(repeats):
        for ids, reference in zip(prompts, references):
            modes: list[float | None] = [None, *acceptance_lengths]
            rotation = repeat % len(modes)
            for tau in modes[rotation:] + modes[:rotation]:
                if tau is None:
                    result = generate(model, list(ids), options=plain_options)
                    plain_tps.append(result.generation_tps)
                    continue
                proposer = ControlledProposer(
                    inner(ids), reference, prompt_len=len(ids), vocab_size=target.args.vocab_size, acceptance_length=tau
                )
                result = generate(model, list(ids), options=controlled_options, proposer=proposer)
                by_tau[tau]["tps"].append(result.generation_tps)
                by_tau[tau]["lengths"].extend(result.acceptance_lengths)
                by_tau[tau]["match"].append(result.tokens == reference[: len(result.tokens)])
            for _ in range(probe_samples):
                for name, piece in pieces.items():
                    build, total = piece()
                    probe_ms[name].append(1000 * total)
                    probe_ms[f"{name}_build"].append(1000 * build)

    draft_ms, verify_ms = median(probe_ms["draft"]), median(probe_ms["verify"])
    compute_ms = draft_ms + verify_ms - median(probe_ms["draft_build"]) - median(probe_ms["verify_build"])

    plain = median(plain_tps)
    decode_ms = 1000 / plain if plain > 0 else math.inf
    rows = []
    for tau, runs in by_tau.items():
        tps = median(runs["tps"])
        measured_tau = mean(runs["lengths"])
        ideal = ideal_speedup(measured_tau, decode_ms=decode_ms, draft_ms=draft_ms, verify_ms=verify_ms)
        speedup = tps / plain if plain > 0 else 0.0
        rows.append(
            {
                "target_acceptance_length": tau,
                "measured_acceptance_length": measured_tau,
                "tokens_per_second": tps,
                "tokens_per_second_runs": runs["tps"],
                "measured_speedup": speedup,
                "ideal_speedup": ideal,
                "efficiency": speedup / ideal if ideal > 0 else 0.0,
                "round_ms": 1000 * measured_tau / tps if tps > 0 else math.inf,
                "ideal_round_ms": draft_ms + verify_ms,
                "outputs_match_reference": sum(runs["match"]) / len(runs["match"]),
            }
        )
    # The round breakdown at the acceptance nearest the model card's greedy 4.55.
    profile_tau = min(acceptance_lengths, key=lambda tau: abs(tau - 4.55))
    profile_proposer = ControlledProposer(
        inner(prompts[0]),
        references[0],
        prompt_len=len(prompts[0]),
        vocab_size=target.args.vocab_size,
        acceptance_length=profile_tau,
    )
    rounds = max(2, min(20, int(max_tokens / profile_tau) - 2))
    profile = profile_rounds(target, profile_proposer, prompts[0], rounds=rounds, compute_ms=compute_ms)
    profile["target_acceptance_length"] = profile_tau
    return {
        "label": "engine measurement (controlled acceptance), not model acceptance",
        "head": head or "draft",
        "draft_tokens": block,
        **({} if head is None else chain_cost(probe_ms, steps=block)),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "prompt_tokens": [len(ids) for ids in prompts],
        "plain_tokens_per_second": plain,
        "plain_tokens_per_second_runs": plain_tps,
        "decode_ms": decode_ms,
        "probe_context": probe.context,
        "draft_ms": draft_ms,
        "verify_ms": verify_ms,
        "draft_ms_samples": probe_ms["draft"],
        "verify_ms_samples": probe_ms["verify"],
        "rows": rows,
        "profile": profile,
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
    }


def chain_cost(probe_ms: dict[str, list[float]], *, steps: int) -> dict:
    """A chain's interleaved cost: one draft, and each further chained step (JSON-ready)."""
    first, chain = median(probe_ms["draft_first"]), median(probe_ms["draft"])
    return {"draft_first_ms": first, "draft_step_ms": step_ms(chain_ms=chain, first_ms=first, steps=steps),
            "draft_first_ms_samples": probe_ms["draft_first"]}  # fmt: skip


def draft_cost_text(result: dict) -> str:
    """The draft's side of the ideal round: a block forward, or a chain's first draft and cost per step."""
    if "draft_step_ms" not in result:
        return f"draft block of {result['draft_tokens']} {result['draft_ms']:.1f} ms"
    return (f"{result['head']} chain of {result['draft_tokens']} {result['draft_ms']:.1f} ms (first draft "
            f"{result['draft_first_ms']:.1f} ms, {result['draft_step_ms']:.2f} ms per chained step)")  # fmt: skip


def format_controlled(result: dict) -> str:
    lines = [
        "ENGINE MEASUREMENT at controlled acceptance (the draft's tokens are replaced; not model acceptance)",
        f"  plain decoding {result['plain_tokens_per_second']:.1f} tok/s ({result['decode_ms']:.1f} ms/token); "
        f"{draft_cost_text(result)}, verify of {result['draft_tokens']} + 1 tokens {result['verify_ms']:.1f} ms "
        f"(interleaved, context {result['probe_context']})",
        f"  {'tau target':>10} {'tau meas.':>9} {'tok/s':>8} {'speedup':>8} {'ideal':>7} {'efficiency':>10} {'round ms':>9} {'ideal ms':>9}",
    ]
    for row in result["rows"]:
        lines.append(
            f"  {row['target_acceptance_length']:>10.2f} {row['measured_acceptance_length']:>9.2f} {row['tokens_per_second']:>8.1f} "
            f"{row['measured_speedup']:>7.2f}x {row['ideal_speedup']:>6.2f}x {row['efficiency']:>10.2f} "
            f"{row['round_ms']:>9.1f} {row['ideal_round_ms']:>9.1f}"
        )
    lines.append(f"  loadavg {result['loadavg_before']} -> {result['loadavg_after']}")
    lines.append(format_profile(result["profile"]))
    return "\n".join(lines)
