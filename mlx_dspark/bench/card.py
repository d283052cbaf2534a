"""The model card's four acceptance columns, each run with the `fixed` and the `confidence` verify schedule.

Columns (DSPARK.md section 1): T=1 with high / low / no thinking and probabilistic drafting, and T=0 with
high thinking and greedy drafting, maximum output 4096 tokens as the card (configurable). Thinking goes
through the target's chat template switches: spark2_5 `thinking_effort` ("high" / "low"; no thinking =
the switch unset, None), qwen3 `enable_thinking` (no effort levels, so no "low" column). Per prompt the
two schedules alternate which goes first (same seed), so load drifts hit both; the scheduler's effect
is the tok/s ratio confidence / fixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from mlx_dspark.api import GenerationResult, encode_prompt, generate
from mlx_dspark.bench.prompts import BenchPrompt
from mlx_dspark.bench.runner import RunSettings
from mlx_dspark.bench.stats import mean, median
from mlx_dspark.engine.costs.curve import CostCurve

CARD_MAX_TOKENS = 4096
SCHEDULES = ("fixed", "confidence")
THINKING_SWITCHES: dict[str, dict[str, dict]] = {
    "spark2_5": {"high": {"thinking_effort": "high"}, "low": {"thinking_effort": "low"}, "none": {"thinking_effort": None}},
    "qwen3": {"high": {"enable_thinking": True}, "none": {"enable_thinking": False}},
}


@dataclass(frozen=True)
class Column:
    name: str
    temperature: float
    draft_sampling: str
    thinking: str  # a key of THINKING_SWITCHES[family]
    card_acceptance: float  # the model card's mean acceptance length for this column


CARD_COLUMNS = (
    Column("T=1 high thinking, sampled drafts", 1.0, "sample", "high", 4.02),
    Column("T=1 low thinking, sampled drafts", 1.0, "sample", "low", 4.07),
    Column("T=1 no thinking, sampled drafts", 1.0, "sample", "none", 4.50),
    Column("T=0 high thinking, greedy drafts", 0.0, "greedy", "high", 4.55),
)


def _summary(runs: Sequence[GenerationResult]) -> dict:
    lengths = [a for r in runs for a in r.acceptance_lengths]
    proposed = [p for r in runs for p in r.proposal_lengths]
    return {
        "mean_acceptance_length": round(mean(lengths), 3),
        "mean_verified_drafts": round(mean(proposed), 3),
        "rounds": len(lengths),
        "generated_tokens": sum(len(r.tokens) for r in runs),
        "generation_tps": median([r.generation_tps for r in runs]),
        "generation_tps_runs": [r.generation_tps for r in runs],
    }


def run_card_columns(
    model: Any,
    prompts: Sequence[BenchPrompt],
    settings: RunSettings,
    *,
    cost_curve: CostCurve,
    max_tokens: int = CARD_MAX_TOKENS,
) -> dict:
    """Every card column the target's template has, over `prompts`, fixed vs confidence (interleaved)."""
    family = model.target_config.get("model_type")
    if family not in THINKING_SWITCHES:
        raise ValueError(f"no thinking switches known for target family {family!r}; expected one of {sorted(THINKING_SWITCHES)}")
    switches = THINKING_SWITCHES[family]
    base = settings.generation
    columns = []
    for column in CARD_COLUMNS:
        if column.thinking not in switches:
            continue
        template_kwargs = {**(base.chat_template_kwargs or {}), **switches[column.thinking]}
        runs: dict[str, list[GenerationResult]] = {s: [] for s in SCHEDULES}
        for i, prompt in enumerate(prompts):
            ids = encode_prompt(model.tokenizer, list(prompt.messages), chat_template_kwargs=template_kwargs)
            for repeat in range(settings.repeats):
                order = SCHEDULES if (i + repeat) % 2 == 0 else SCHEDULES[::-1]
                for schedule in order:
                    options = base.replace(
                        max_tokens=max_tokens,
                        chat_template_kwargs=template_kwargs,
                        temperature=column.temperature,
                        seed=settings.seed + repeat,
                        speculative=True,
                        draft_sampling=column.draft_sampling,
                        verify_schedule=schedule,
                        cost_curve=cost_curve,
                    )
                    runs[schedule].append(generate(model, ids, options=options))
        summaries = {s: _summary(r) for s, r in runs.items()}
        fixed_tps = summaries["fixed"]["generation_tps"]
        columns.append(
            {
                "column": column.name,
                "template_kwargs": switches[column.thinking],
                "card_acceptance_length": column.card_acceptance,
                **summaries,
                "confidence_over_fixed_tps": summaries["confidence"]["generation_tps"] / fixed_tps if fixed_tps > 0 else 0.0,
            }
        )
    return {
        "max_tokens": max_tokens,
        "prompts": len(prompts),
        "repeats": settings.repeats,
        "cost_curve": {**cost_curve.to_json(), "source": cost_curve.source},
        "columns": columns,
    }


def format_card_columns(result: dict) -> str:
    lines = [
        f"Model-card acceptance columns ({result['prompts']} prompts x {result['repeats']} repeats, max {result['max_tokens']} tokens; "
        f"cost curve: {result['cost_curve']['source']})",
        f"  {'column':<36} {'card':>5} {'acc. fixed':>10} {'acc. conf.':>10} {'drafts/round f/c':>16} {'tok/s fixed':>11} {'tok/s conf.':>11} {'conf/fixed':>10}",
    ]
    for c in result["columns"]:
        fixed, conf = c["fixed"], c["confidence"]
        lines.append(
            f"  {c['column']:<36} {c['card_acceptance_length']:>5.2f} {fixed['mean_acceptance_length']:>10.2f} "
            f"{conf['mean_acceptance_length']:>10.2f} {fixed['mean_verified_drafts']:>7.2f}/{conf['mean_verified_drafts']:<8.2f} "
            f"{fixed['generation_tps']:>11.1f} {conf['generation_tps']:>11.1f} {c['confidence_over_fixed_tps']:>9.2f}x"
        )
    return "\n".join(lines)
