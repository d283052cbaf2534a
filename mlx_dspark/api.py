"""The public Python API: `generate` and `stream_generate` over a loaded target (and draft).

`stream_generate` turns the step generators of `decode.py` into responses with new text and
statistics; `generate` joins them. Stop tokens, stop strings and max_tokens are applied here, so the
plain and the speculative path share exactly the same rules.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import mlx.core as mx

from mlx_dspark.chat_format.prompt import encode_prompt  # noqa: F401  (re-exported)
from mlx_dspark.chat_format.tools import ToolCall, ToolChoice
from mlx_dspark.chat_format.turn import OutputCollector, ToolSetup
from mlx_dspark.engine.context import ContextLengthError, context_length, fit_max_tokens  # noqa: F401  (re-exported)
from mlx_dspark.engine.constraints import Constraint
from mlx_dspark.engine.decode import GenerationCancelled, Round, plain_steps, speculative_steps  # noqa: F401  (re-exported)
from mlx_dspark.engine.grammar import GrammarState
from mlx_dspark.engine.logprobs import TokenLogprob
from mlx_dspark.engine.options import DEFAULT_OPTIONS, GenerationOptions, SamplingOptions, SpeculationOptions
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.propose import Proposer
from mlx_dspark.engine.schedule import CostCurve
from mlx_dspark.engine.steps import compile_request, make_steps


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


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters could still grow into a stop string (so are not shown yet)."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return hold


_SAMPLING, _SPECULATION = DEFAULT_OPTIONS.sampling, DEFAULT_OPTIONS.speculation


def stream_generate(
    model: Any,
    prompt: str | Sequence[int] | Sequence[dict],
    *,
    options: GenerationOptions | None = None,
    proposer: Proposer | None = None,
    prompt_cache: PromptCache | None = None,
    cancel: threading.Event | None = None,
    max_tokens: int = DEFAULT_OPTIONS.max_tokens,
    max_context: int | None = DEFAULT_OPTIONS.max_context,
    prefill_step_size: int = DEFAULT_OPTIONS.prefill_step_size,
    temperature: float = _SAMPLING.temperature,
    top_p: float = _SAMPLING.top_p,
    top_k: int = _SAMPLING.top_k,
    min_p: float = _SAMPLING.min_p,
    seed: int | None = _SAMPLING.seed,
    presence_penalty: float = _SAMPLING.presence_penalty,
    frequency_penalty: float = _SAMPLING.frequency_penalty,
    repetition_penalty: float = _SAMPLING.repetition_penalty,
    penalty_last_n: int = _SAMPLING.penalty_last_n,
    logit_bias: dict[int, float] | None = None,
    logprobs: int | None = DEFAULT_OPTIONS.logprobs,
    constraint: Constraint | None = DEFAULT_OPTIONS.constraint,
    draft_sampling: str = _SPECULATION.draft_sampling,
    speculative: bool = _SPECULATION.speculative,
    confidence_threshold: float = _SPECULATION.confidence_threshold,
    p_min: float = _SPECULATION.p_min,
    max_draft_tokens: int | str | None = _SPECULATION.max_draft_tokens,
    verify_schedule: str = _SPECULATION.verify_schedule,
    cost_curve: CostCurve | None = _SPECULATION.cost_curve,
    mask_draft: bool = _SPECULATION.mask_draft,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    chat_template_kwargs: dict | None = None,
    tools: Sequence[dict] | None = None,
    tool_choice: str | dict | ToolChoice | None = None,
    parallel_tool_calls: bool = True,
) -> Iterator[StepResponse]:
    """Yield a StepResponse per target forward; the last one carries the finish reason.

    The options come either whole as `options` (what the CLIs, the server and the benchmark pass) or
    as the keywords, the documented front that builds the same object here, once; giving both is an
    error. `proposer` replaces the loaded draft (tests and benchmarks plug in controlled proposers).
    `prompt_cache` (from `make_prompt_cache`) keeps a conversation warm: the prompt's prefix that it
    already holds is not prefilled again (`cached_tokens`).
    The prompt plus `max_tokens` must fit in `max_context` (default: the target's
    `max_position_embeddings`): a `ContextLengthError` (a ValueError naming the numbers) before any
    model work otherwise. `cancel`, a `threading.Event` another thread may set, stops the generation
    between prefill chunks (of `prefill_step_size` tokens) or rounds: the stream raises
    `GenerationCancelled`.
    `max_draft_tokens="auto"` (the default) chooses each round's draft length from `cost_curve`, or else
    this machine's curve for the pair (measured once, cached on disk), and the acceptance seen so far,
    drafting nothing while no length pays (engine/draft_length.py); an integer is a fixed cap.
    `verify_schedule="confidence"` needs a draft with a confidence head (an error otherwise) and uses
    `cost_curve`, or else this machine's curve for the pair (schedule.py: measured once, cached on disk).
    `tools` (OpenAI function tools) are rendered by the chat template; the last step of a chat prompt
    carries its text read as `content`, `reasoning` and `tool_calls` (the tokenizer's tool parser);
    `tool_choice` "required" or {"type": "function", "function": {"name": ...}} forces a call
    (constrained decoding), "none" offers no tools.
    """
    built = GenerationOptions(
        max_tokens=max_tokens,
        max_context=max_context,
        prefill_step_size=prefill_step_size,
        stop=stop or (),
        stop_token_ids=stop_token_ids or (),
        chat_template_kwargs=chat_template_kwargs,
        logprobs=logprobs,
        constraint=constraint,
        sampling=SamplingOptions(
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, penalty_last_n=penalty_last_n,
            logit_bias=logit_bias or (),
        ),
        speculation=SpeculationOptions(
            speculative=speculative,
            draft_sampling=draft_sampling,
            p_min=p_min,
            confidence_threshold=confidence_threshold,
            max_draft_tokens=max_draft_tokens,
            verify_schedule=verify_schedule,
            cost_curve=cost_curve,
            mask_draft=mask_draft,
        ),
    )
    if options is None:
        options = built
    elif built != DEFAULT_OPTIONS:
        raise ValueError("give the generation options either as `options=` or as keywords, not both")
    setup = ToolSetup.of(tools, tool_choice, parallel=parallel_tool_calls)  # a ToolError (ValueError) naming the field
    forced = setup.constraint(model.tokenizer)
    if forced is not None:
        if options.constraint is not None:
            raise ValueError("tool_choice forces a tool call: it cannot be combined with constraint=")
        options = dataclasses.replace(options, constraint=forced)
    grammar = compile_request(model, options)  # here, not in the stream: a bad constraint fails at the call
    return _stream(model, prompt, options, proposer, prompt_cache, cancel, grammar, setup)


def _stream(
    model: Any,
    prompt: str | Sequence[int] | Sequence[dict],
    options: GenerationOptions,
    proposer: Proposer | None,
    prompt_cache: PromptCache | None,
    cancel: threading.Event | None,
    grammar: GrammarState | None,
    setup: ToolSetup,
) -> Iterator[StepResponse]:
    tokenizer = model.tokenizer
    stops = options.stop
    stop_ids = set(tokenizer.eos_token_ids) | set(options.stop_token_ids)
    prompt_ids = encode_prompt(tokenizer, prompt, chat_template_kwargs=options.chat_template_kwargs, tools=setup.offered)
    chat = not isinstance(prompt, str) and any(isinstance(m, dict) for m in prompt)
    reader = OutputCollector(setup.parser(tokenizer, prompt_ids)) if chat or setup.tools else None
    max_tokens = fit_max_tokens(len(prompt_ids), options, *context_length(model, options))
    if max_tokens != options.max_tokens:
        options = dataclasses.replace(options, max_tokens=max_tokens)

    if options.sampling.seed is not None:
        mx.random.seed(options.sampling.seed)
    mx.reset_peak_memory()
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    shown = 0  # characters of detokenizer.text already yielded
    generated = 0
    start = time.perf_counter()
    first_token_time = None
    for step in make_steps(model, prompt_ids, options, proposer, prompt_cache, cancel, grammar):
        now = time.perf_counter()
        if first_token_time is None:
            first_token_time = now
            cached = 0 if prompt_cache is None else prompt_cache.cached_tokens  # the resume just happened
        finish_reason = None
        tokens: list[int] = []
        for token in step.tokens:
            tokens.append(token)
            generated += 1
            if token in stop_ids:
                finish_reason = "stop"
                break
            detokenizer.add_token(token)
            if generated >= max_tokens:
                finish_reason = "length"
                break
        if finish_reason is not None:
            detokenizer.finalize()
        text = detokenizer.text
        cut = min((i for i in (text.find(s, max(0, shown - len(s))) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            text, finish_reason = text[:cut], "stop"
        visible = len(text) if finish_reason else len(text) - _held_back(text, stops)
        new_text = text[shown:visible] if visible > shown else ""
        shown = max(shown, visible)
        elapsed = now - first_token_time
        if reader is not None:
            reader.add(new_text, final=finish_reason is not None)
        parsed = reader.output if reader is not None and finish_reason is not None else None
        yield StepResponse(
            text=new_text,
            tokens=tokens,
            accepted=step.accepted,
            proposed=step.proposed,
            verified=step.verified,
            finish_reason=finish_reason,
            prompt_tokens=len(prompt_ids),
            prompt_tps=(len(prompt_ids) - cached) / max(first_token_time - start, 1e-9),  # prefilled tokens only
            generation_tokens=generated,
            generation_tps=(generated - 1) / elapsed if generated > 1 and elapsed > 0 else 0.0,
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            cached_tokens=cached,
            logprobs=None if step.logprobs is None else step.logprobs[: len(tokens)],
            content=None if parsed is None else parsed.content,
            reasoning=None if parsed is None else parsed.reasoning,
            tool_calls=None if parsed is None else parsed.tool_calls,
        )
        if finish_reason is not None:
            return


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


def make_prompt_cache(model: Any, *, max_snapshots: int = 4, snapshot_margin: int = 16) -> PromptCache:
    """A prompt cache for `model`'s target (and draft): pass it to every turn of one conversation."""
    return PromptCache(model.target, model.draft, max_snapshots=max_snapshots, snapshot_margin=snapshot_margin)


def generate(
    model: Any,
    prompt: str | Sequence[int] | Sequence[dict],
    *,
    options: GenerationOptions | None = None,
    proposer: Proposer | None = None,
    prompt_cache: PromptCache | None = None,
    cancel: threading.Event | None = None,
    max_tokens: int = DEFAULT_OPTIONS.max_tokens,
    max_context: int | None = DEFAULT_OPTIONS.max_context,
    prefill_step_size: int = DEFAULT_OPTIONS.prefill_step_size,
    temperature: float = _SAMPLING.temperature,
    top_p: float = _SAMPLING.top_p,
    top_k: int = _SAMPLING.top_k,
    min_p: float = _SAMPLING.min_p,
    seed: int | None = _SAMPLING.seed,
    presence_penalty: float = _SAMPLING.presence_penalty,
    frequency_penalty: float = _SAMPLING.frequency_penalty,
    repetition_penalty: float = _SAMPLING.repetition_penalty,
    penalty_last_n: int = _SAMPLING.penalty_last_n,
    logit_bias: dict[int, float] | None = None,
    logprobs: int | None = DEFAULT_OPTIONS.logprobs,
    constraint: Constraint | None = DEFAULT_OPTIONS.constraint,
    draft_sampling: str = _SPECULATION.draft_sampling,
    speculative: bool = _SPECULATION.speculative,
    confidence_threshold: float = _SPECULATION.confidence_threshold,
    p_min: float = _SPECULATION.p_min,
    max_draft_tokens: int | str | None = _SPECULATION.max_draft_tokens,
    verify_schedule: str = _SPECULATION.verify_schedule,
    cost_curve: CostCurve | None = _SPECULATION.cost_curve,
    mask_draft: bool = _SPECULATION.mask_draft,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    chat_template_kwargs: dict | None = None,
    tools: Sequence[dict] | None = None,
    tool_choice: str | dict | ToolChoice | None = None,
    parallel_tool_calls: bool = True,
) -> GenerationResult:
    """Generate a whole completion: `stream_generate` with the same parameters, joined.

    The signature is stream_generate's, spelled out so that both stay documented, typed functions
    without a `**kwargs` pass-through (tests/test_package_api.py keeps the two in step).
    """
    steps = stream_generate(
        model,
        prompt,
        options=options,
        proposer=proposer,
        prompt_cache=prompt_cache,
        cancel=cancel,
        max_tokens=max_tokens,
        max_context=max_context,
        prefill_step_size=prefill_step_size,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        penalty_last_n=penalty_last_n,
        logit_bias=logit_bias,
        logprobs=logprobs,
        constraint=constraint,
        draft_sampling=draft_sampling,
        speculative=speculative,
        confidence_threshold=confidence_threshold,
        p_min=p_min,
        max_draft_tokens=max_draft_tokens,
        verify_schedule=verify_schedule,
        cost_curve=cost_curve,
        mask_draft=mask_draft,
        stop=stop,
        stop_token_ids=stop_token_ids,
        chat_template_kwargs=chat_template_kwargs,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
    )
    collector = ResultCollector()
    for step in steps:
        collector.add(step)
    return collector.result()
