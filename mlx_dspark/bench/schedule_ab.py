"""Fixed vs confidence verify schedule at a controlled, calibrated acceptance profile (benchmark-only).

Random-weight pairs have meaningless confidences, so `CalibratedProposer` runs the real draft forward
every round (its cost is paid) but proposes the target's greedy continuation and reports synthetic
confidences that are calibrated by construction: each round draws a difficulty (easy with probability
`p_easy`, else hard), every position k is then accepted with the difficulty's probability c given that
1..k-1 were (the first failure is corrupted), and the proposal reports c(k) = c. The scheduler sees
exactly the information a well-calibrated head gives. Runs alternate fixed / confidence per prompt and
repeat with the same random stream, on this machine's cost curve and on a flat (GPU-like) one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from mlx_dspark.api import generate
from mlx_dspark.bench.controlled import greedy_reference, reference_block
from mlx_dspark.bench.stats import loadavg, mean, median
from mlx_dspark.engine.options import GenerationOptions
from mlx_dspark.engine.proposers.base import Proposal, Proposer
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.engine.costs.curve import CostCurve, scheduled_length


@dataclass(frozen=True)
class Profile:
    """A two-state acceptance profile: per-position acceptance `easy` or `hard`, easy rounds with `p_easy`."""

    easy: float = 0.92
    hard: float = 0.35
    p_easy: float = 0.6


class CalibratedProposer(Proposer):
    """The target's greedy continuation behind a real draft forward, with calibrated synthetic confidences."""

    def __init__(self, inner: DraftProposer, reference: Sequence[int], *, prompt_len: int, vocab_size: int, profile: Profile, seed: int):
        self.inner = inner
        self.reference = list(reference)
        self.prompt_len = prompt_len
        self.vocab_size = vocab_size
        self.profile = profile
        self.rng = random.Random(seed)
        self.tap_ids = inner.tap_ids
        self.block_size = inner.block_size

    def extend(self, features: mx.array) -> None:
        self.inner.extend(features)

    def propose(self, anchor: mx.array, *, position: int, num_tokens: int) -> Proposal:
        real = self.inner.propose(anchor, position=position, num_tokens=num_tokens)
        c = self.profile.easy if self.rng.random() < self.profile.p_easy else self.profile.hard
        # draw every position's coin, so the random stream does not depend on how much is verified
        coins = [self.rng.random() < c for _ in range(self.block_size)]
        first_failure = next((k for k, ok in enumerate(coins[:num_tokens]) if not ok), None)
        tokens = reference_block(real, self.reference, start=position - self.prompt_len + 1, num_tokens=num_tokens,
                                 wrong=first_failure, vocab_size=self.vocab_size)  # fmt: skip
        return Proposal(tokens=tokens, confidence=mx.full((1, num_tokens), c, dtype=mx.float32))


def expected_rate(profile: Profile, curve: CostCurve, *, block_size: int, scheduled: bool) -> float:
    """Tokens per millisecond the profile gives on `curve` (the ideal, no overhead): sum of E / sum of T."""
    tokens = cost = 0.0
    for c, weight in ((profile.easy, profile.p_easy), (profile.hard, 1 - profile.p_easy)):
        length = scheduled_length([c] * block_size, curve) if scheduled else block_size
        tokens += weight * sum(c**k for k in range(length + 1))
        cost += weight * curve.round_ms(length)
    return tokens / cost


def run_schedule_ab(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    machine_curve: CostCurve,
    max_tokens: int,
    repeats: int,
    profile: Profile = Profile(),
) -> dict:
    """Interleaved greedy runs, fixed vs confidence, on the machine's curve and on a flat one (stop tokens off)."""
    target, draft = model.target, model.draft
    block = int(draft.num_drafts)
    curves = {"machine": machine_curve, "flat": CostCurve.flat(max_width=block + 1)}
    references = [greedy_reference(target, ids, max_tokens + block + 1) for ids in prompts]
    modes = [("fixed", None), *((f"confidence ({name} curve)", curve) for name, curve in curves.items())]
    runs: dict[str, dict[str, list]] = {name: {"tps": [], "lengths": [], "proposed": [], "match": []} for name, _ in modes}
    load_before = loadavg()
    for repeat in range(repeats):
        for i, (ids, reference) in enumerate(zip(prompts, references)):
            rotation = (repeat + i) % len(modes)
            for name, curve in modes[rotation:] + modes[:rotation]:
                proposer = CalibratedProposer(
                    DraftProposer(draft, target, greedy=True, temperature=1.0),
                    reference,
                    prompt_len=len(ids),
                    vocab_size=target.args.vocab_size,
                    profile=profile,
                    seed=1000 * repeat + i,  # the same stream for every mode
                )
                options = GenerationOptions.from_keywords(
                    max_tokens=max_tokens, verify_schedule="fixed" if curve is None else "confidence", cost_curve=curve,
                    max_draft_tokens=None,  # full blocks, cut by the schedule alone
                )
                result = generate(model, list(ids), options=options, proposer=proposer)
                runs[name]["tps"].append(result.generation_tps)
                runs[name]["lengths"].extend(result.acceptance_lengths)
                runs[name]["proposed"].extend(result.proposal_lengths)
                runs[name]["match"].append(result.tokens == reference[: len(result.tokens)])
    fixed_tps = median(runs["fixed"]["tps"])
    rows = []
    for name, curve in modes:
        data = runs[name]
        tps = median(data["tps"])
        rows.append(
            {
                "mode": name,
                "tokens_per_second": tps,
                "tokens_per_second_runs": data["tps"],
                "over_fixed": tps / fixed_tps if fixed_tps > 0 else 0.0,
                "mean_acceptance_length": round(mean(data["lengths"]), 3),
                "mean_verified_drafts": round(mean(data["proposed"]), 3),
                "outputs_match_reference": sum(data["match"]) / len(data["match"]),
            }
        )
    ideal = {
        name: expected_rate(profile, curve, block_size=block, scheduled=True) / expected_rate(profile, curve, block_size=block, scheduled=False)
        for name, curve in curves.items()
    }
    return {
        "label": "controlled, calibrated synthetic confidences (the draft's own confidences are random); greedy; not model acceptance",
        "profile": vars(profile),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "prompt_tokens": [len(ids) for ids in prompts],
        "machine_curve": {**machine_curve.to_json(), "source": machine_curve.source},
        "ideal_confidence_over_fixed": ideal,
        "rows": rows,
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
    }


def format_schedule_ab(result: dict) -> str:
    profile = result["profile"]
    curve = result["machine_curve"]
    lines = [
        "VERIFY SCHEDULE A/B at a controlled, calibrated confidence profile (synthetic confidences; not model acceptance)",
        f"  profile: easy rounds c={profile['easy']} (p={profile['p_easy']}), hard rounds c={profile['hard']}; "
        f"machine curve ({curve['source']}): draft {curve['draft_block_ms']:.1f} ms, verify "
        + ", ".join(f"{w}:{ms:.0f}" for w, ms in curve["verify_ms"].items())
        + " ms",
        f"  ideal confidence/fixed: machine curve {result['ideal_confidence_over_fixed']['machine']:.3f}x, flat curve {result['ideal_confidence_over_fixed']['flat']:.3f}x",
        f"  {'mode':<28} {'tok/s':>7} {'/fixed':>7} {'acc. len':>8} {'drafts/round':>12} {'match':>6}",
    ]
    for row in result["rows"]:
        lines.append(
            f"  {row['mode']:<28} {row['tokens_per_second']:>7.2f} {row['over_fixed']:>6.3f}x {row['mean_acceptance_length']:>8.2f} "
            f"{row['mean_verified_drafts']:>12.2f} {row['outputs_match_reference']:>6.2f}"
        )
    lines.append(f"  loadavg {result['loadavg_before']} -> {result['loadavg_after']}")
    return "\n".join(lines)
