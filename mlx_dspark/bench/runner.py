"""Per-prompt A/B runs: our plain decoding, DSpark, and mlx-lm's plain generation, interleaved.

Each prompt runs `repeats` times in each mode inside one process, alternating which mode goes first,
so slow drifts of a shared machine hit both; mlx-lm's baseline runs once per prompt between them.
Speeds are medians over repeats; acceptance counts pool every DSpark round.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from mlx_dspark.loading.heads import head_loader, target_heads
from mlx_dspark.api import GenerationResult, encode_prompt, generate
from mlx_dspark.engine.proposers import default_head, head_block, loaded_heads
from mlx_dspark.engine.options import GenerationOptions
from mlx_dspark.bench.lossless import compare_greedy
from mlx_dspark.bench.mlx_lm_baseline import MlxLmBaseline, run_mlx_lm
from mlx_dspark.bench.prompts import BenchPrompt
from mlx_dspark.bench.stats import acceptance_histogram, mean, median, position_acceptance


@dataclass(frozen=True)
class RunSettings:
    """How every timed run generates; repeat r of a prompt uses seed `generation.sampling.seed + r`."""

    generation: GenerationOptions = GenerationOptions(max_tokens=128)
    repeats: int = 1
    ignore_eos: bool = False  # random-weight pairs: always generate max_tokens
    warmup_tokens: int = 16

    def __post_init__(self) -> None:
        max_tokens = self.generation.max_tokens
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2 (tok/s is measured after the first token), got {max_tokens}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")

    @property
    def max_tokens(self) -> int:
        return self.generation.max_tokens

    @property
    def seed(self) -> int:
        return self.generation.sampling.seed or 0

    @property
    def greedy(self) -> bool:
        return self.generation.sampling.greedy

    def options(self, *, speculative: bool, seed: int, max_tokens: int | None = None) -> GenerationOptions:
        """The run's options: one mode, one seed, and `max_tokens` for the short warm-up runs."""
        generation = self.generation
        return generation.replace(max_tokens=max_tokens or generation.max_tokens, seed=seed, speculative=speculative)


class _NoStopTokenizer:
    """A tokenizer view without end-of-sequence ids, so a run always reaches max_tokens."""

    eos_token_ids: frozenset = frozenset()

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def prepare_model(loaded: Any, settings: RunSettings) -> Any:
    """The loaded pair as the runs use it (without stop ids when `ignore_eos`)."""
    if not settings.ignore_eos:
        return loaded
    return dataclasses.replace(loaded, tokenizer=_NoStopTokenizer(loaded.tokenizer))


def prompt_ids(loaded: Any, prompt: BenchPrompt) -> list[int]:
    """Token ids of a prompt: the chat template when the tokenizer has one, else the raw text."""
    tokenizer = loaded.tokenizer
    if getattr(tokenizer, "has_chat_template", False):
        return encode_prompt(tokenizer, list(prompt.messages))
    return encode_prompt(tokenizer, prompt.text)


def _run(model: Any, ids: list[int], settings: RunSettings, *, speculative: bool, seed: int, max_tokens: int | None = None) -> GenerationResult:
    return generate(model, ids, options=settings.options(speculative=speculative, seed=seed, max_tokens=max_tokens))


def _mlx_lm(model: Any, baseline: MlxLmBaseline, ids: list[int], settings: RunSettings, *, max_tokens: int):
    stop_ids = set(model.tokenizer.eos_token_ids)
    return run_mlx_lm(baseline, ids, max_tokens=max_tokens, sampling=settings.generation.sampling, stop_ids=stop_ids)


def warm_up(model: Any, ids: list[int], settings: RunSettings, baseline: MlxLmBaseline | None) -> None:
    """One short run of every path (kernel compilation, allocator growth) before anything is timed."""
    tokens = max(2, min(settings.warmup_tokens, settings.max_tokens))
    for speculative in (False, True):
        _run(model, ids, settings, speculative=speculative, seed=settings.seed, max_tokens=tokens)
    if baseline is not None:
        _mlx_lm(model, baseline, ids, settings, max_tokens=tokens)


def _speed_summary(runs: Sequence[Any]) -> dict:
    return {
        "generation_tps": median([r.generation_tps for r in runs]),
        "time_to_first_token": median([r.time_to_first_token for r in runs]),
        "total_time": median([r.total_time for r in runs]),
        "peak_memory_gb": max(r.peak_memory_gb for r in runs),
        "generated_tokens": len(runs[0].tokens),
        "generation_tps_runs": [r.generation_tps for r in runs],
    }


def _acceptance_summary(runs: Sequence[GenerationResult], *, block_size: int) -> dict:
    lengths = [a for r in runs for a in r.acceptance_lengths]
    proposals = [p for r in runs for p in r.proposal_lengths]
    # a lookup block (or a grammar's forced run) can be longer than the draft's block: up to 32 tokens
    longest = max([block_size, *proposals])
    return {
        "mean_acceptance_length": round(mean(lengths), 3),
        "rounds": len(lengths),
        "acceptance_histogram": acceptance_histogram(lengths, block_size=longest),
        "position_acceptance": position_acceptance(lengths, proposals, block_size=block_size),
        "target_forwards_per_token": (len(runs[0].acceptance_lengths) + 1) / max(len(runs[0].tokens), 1),
    }


def run_prompt(model: Any, prompt: BenchPrompt, settings: RunSettings, baseline: MlxLmBaseline | None) -> dict:
    """One prompt: interleaved baseline / DSpark repeats and one mlx-lm run; a JSON-ready record."""
    ids = prompt_ids(model, prompt)
    plain: list[GenerationResult] = []
    speculative: list[GenerationResult] = []
    mlx_lm_run = None
    for repeat in range(settings.repeats):
        seed = settings.seed + repeat
        order = (False, True) if repeat % 2 == 0 else (True, False)
        for spec in order:
            (speculative if spec else plain).append(_run(model, ids, settings, speculative=spec, seed=seed))
        if repeat == 0 and baseline is not None:
            mlx_lm_run = _mlx_lm(model, baseline, ids, settings, max_tokens=len(plain[0].tokens))

    block_size = head_block(model, default_head(model))  # a block draft's block, or a chain's default length
    record = {
        "category": prompt.category,
        "index": prompt.index,
        "prompt_tokens": len(ids),
        "baseline": _speed_summary(plain),
        "dspark": {**_speed_summary(speculative), **_acceptance_summary(speculative, block_size=block_size)},
        "mlx_lm": None,
    }
    best_baseline = record["baseline"]["generation_tps"]
    if mlx_lm_run is not None:
        record["mlx_lm"] = {
            **_speed_summary([mlx_lm_run]),
            "tokens_match_baseline": mlx_lm_run.tokens == plain[0].tokens[: len(mlx_lm_run.tokens)] if settings.greedy else None,
        }
        best_baseline = max(best_baseline, mlx_lm_run.generation_tps)
    record["best_baseline_tps"] = best_baseline
    record["speedup"] = record["dspark"]["generation_tps"] / best_baseline if best_baseline > 0 else 0.0
    record["speedup_vs_our_baseline"] = (
        record["dspark"]["generation_tps"] / record["baseline"]["generation_tps"] if record["baseline"]["generation_tps"] > 0 else 0.0
    )
    record["lossless"] = compare_greedy(model.target, ids, plain[0].tokens, speculative[0].tokens) if settings.greedy else None
    return record


def baseline_parity(model: Any, baseline: MlxLmBaseline, prompt: BenchPrompt, settings: RunSettings, *, repeats: int) -> dict:
    """Our plain decoding against mlx-lm's, `repeats` times each, alternating which goes first.

    The per-prompt runs time mlx-lm once; this is the check that our baseline is no strawman.
    """
    ids = prompt_ids(model, prompt)
    ours: list[float] = []
    theirs: list[float] = []
    for repeat in range(repeats):
        for mode in ("ours", "mlx_lm") if repeat % 2 == 0 else ("mlx_lm", "ours"):
            if mode == "ours":
                ours.append(_run(model, ids, settings, speculative=False, seed=settings.seed).generation_tps)
            else:
                theirs.append(_mlx_lm(model, baseline, ids, settings, max_tokens=settings.max_tokens).generation_tps)
    ratio = median(ours) / median(theirs) if median(theirs) > 0 else 0.0
    return {
        "prompt": f"{prompt.category} #{prompt.index}",
        "mlx_lm_kind": baseline.kind,
        "our_tps_runs": ours,
        "mlx_lm_tps_runs": theirs,
        "our_tps": median(ours),
        "mlx_lm_tps": median(theirs),
        "ours_over_mlx_lm": ratio,
    }


def format_parity(parity: dict) -> str:
    return (
        f"baseline parity on {parity['prompt']} ({len(parity['our_tps_runs'])} interleaved runs each): ours "
        f"{parity['our_tps']:.2f} tok/s, mlx-lm ({parity['mlx_lm_kind']}) {parity['mlx_lm_tps']:.2f} tok/s, "
        f"ratio {parity['ours_over_mlx_lm']:.3f}"
    )


def run_prompts(
    model: Any, prompts: Sequence[BenchPrompt], settings: RunSettings, baseline: MlxLmBaseline | None
) -> Iterator[dict]:
    """Warm up on the first prompt, then yield one record per prompt."""
    if not prompts:
        raise ValueError("no prompts to run")
    if not loaded_heads(model):
        own = ", ".join(f"{name!r} for {head_loader(name).DESCRIPTION}" for name in target_heads())
        raise ValueError(f"the benchmark needs a draft: pass --draft (a draft path, or {own})")
    warm_up(model, prompt_ids(model, prompts[0]), settings, baseline)
    for prompt in prompts:
        yield run_prompt(model, prompt, settings, baseline)
