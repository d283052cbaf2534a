"""What a generation gives back: `StepResponse` per target forward, `ResultCollector` joining them into a
`GenerationResult` (the one place that sums step statistics; api, the CLI and the server read it)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from mlx_dspark.engine.logits.logprobs import TokenLogprob
from mlx_dspark.engine.round.token_origins import token_origins

if TYPE_CHECKING:
    from mlx_dspark.chat_format.tools import ToolCall


@dataclass
class StepResponse:
    """What one step (one target forward) added."""

    text: str  # new text only
    tokens: list[int]  # tokens committed by this step (a stop token is included, never shown as text)
    accepted: int  # draft tokens the verify round accepted (before any stop/max_tokens cut)
    proposed: int  # draft tokens verified this step
    verified: bool  # this step was a speculative verify round
    finish_reason: str | None  # "stop", "length" or None while generating
    prompt_tokens: int
    prompt_tps: float  # prefilled tokens (prompt_tokens - cached_tokens) per second of time to first token
    generation_tokens: int  # tokens generated so far, this step's included
    generation_tps: float
    peak_memory_gb: float
    cached_tokens: int = 0  # prompt tokens reused from the prompt cache (not prefilled)
    logprobs: list[TokenLogprob] | None = None  # one per token of `tokens`, when options.logprobs is set
    # chat prompts, on the last step: the text read as reasoning, content and tool calls (chat_format/output.py)
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None
    # [[characters, origin], ...] over `text`: origin "draft" / "lookup" / "forced" (a verified block's
    # accepted tokens) or "target" (the target's own token); engine/round/token_origins.py
    marks: list[list] | None = None
    source: str | None = None  # the verified block's source, None when nothing was proposed


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    acceptance_lengths: list[int] = field(default_factory=list)  # per verify round: accepted + 1
    proposal_lengths: list[int] = field(default_factory=list)  # per verify round: drafts verified
    time_to_first_token: float = 0.0
    total_time: float = 0.0
    cached_tokens: int = 0
    target_forwards: int = 0  # the prefill's last one, then one per decode step or verify round
    logprobs: list[TokenLogprob] | None = None  # one per token of `tokens`, when options.logprobs is set
    content: str | None = None  # chat prompts: the text without reasoning and tool calls (`text` is all of it)
    reasoning: str | None = None  # the thinking text, when the template thinks
    tool_calls: list[ToolCall] | None = None  # the calls parsed from the text (with `tools=`)

    @property
    def mean_acceptance_length(self) -> float:
        if not self.acceptance_lengths:
            return 0.0
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def draft_lengths(self) -> dict[int, int]:
        """Drafts verified per round -> rounds (0: a parked round, the target alone; draft_length.py)."""
        return length_histogram(self.proposal_lengths)


def length_histogram(proposal_lengths: Sequence[int]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for n in proposal_lengths:
        counts[n] = counts.get(n, 0) + 1
    return dict(sorted(counts.items()))


class ResultCollector:
    """Joins the StepResponses of one stream: the one place that sums step statistics.

    `generate` and the CLI turn it into a GenerationResult; the server's usage and `dspark` fields read it.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_time: float | None = None
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.acceptance_lengths: list[int] = []
        self.proposal_lengths: list[int] = []
        self.steps = 0  # one target forward each (the first: the prefill's)
        self.logprobs: list[TokenLogprob] | None = None
        self.last: StepResponse | None = None
        self.origins: Counter[str] = Counter()  # committed tokens by origin (token_origins.py): /metrics reads it

    def add(self, step: StepResponse) -> None:
        if self.first_time is None:
            self.first_time = time.perf_counter() - self.start
        self.text.append(step.text)
        self.tokens.extend(step.tokens)
        self.steps += 1
        if step.logprobs is not None:
            self.logprobs = (self.logprobs or []) + step.logprobs
        if step.verified:
            self.acceptance_lengths.append(step.accepted + 1)
            self.proposal_lengths.append(step.proposed)
        for origin in token_origins(len(step.tokens), step.accepted, step.source, step.verified):
            self.origins[origin] += 1
        self.last = step

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens accepted over all verify rounds (each round's length counts its bonus token too)."""
        return sum(self.acceptance_lengths) - self.rounds

    @property
    def proposed_tokens(self) -> int:
        return sum(self.proposal_lengths)

    def result(self) -> GenerationResult:
        last = self.last
        assert last is not None and last.finish_reason is not None
        return GenerationResult(
            text="".join(self.text),
            tokens=self.tokens,
            finish_reason=last.finish_reason,
            prompt_tokens=last.prompt_tokens,
            prompt_tps=last.prompt_tps,
            generation_tps=last.generation_tps,
            peak_memory_gb=last.peak_memory_gb,
            acceptance_lengths=self.acceptance_lengths,
            proposal_lengths=self.proposal_lengths,
            time_to_first_token=self.first_time or 0.0,
            total_time=time.perf_counter() - self.start,
            cached_tokens=last.cached_tokens,
            target_forwards=self.steps,
            logprobs=self.logprobs,
            content=last.content,
            reasoning=last.reasoning,
            tool_calls=last.tool_calls,
        )
