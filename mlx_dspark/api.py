"""The public Python API: `generate` and `stream_generate` over a loaded target (and draft).

`stream_generate` turns the step generators of `decode.py` into responses with new text and
statistics; `generate` joins them. Stop tokens, stop strings and max_tokens are applied here, so the
plain and the speculative path share exactly the same rules.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx

from mlx_dspark.chat_format.prompt import encode_prompt  # noqa: F401  (re-exported)
from mlx_dspark.chat_format.tools import ToolChoice
from mlx_dspark.chat_format.turn import OutputCollector, ToolSetup
from mlx_dspark.engine.context_length import ContextLengthError, context_length, fit_max_tokens  # noqa: F401  (re-exported)
from mlx_dspark.engine.round.decode import GenerationCancelled, Round, plain_steps, speculative_steps  # noqa: F401  (re-exported)
from mlx_dspark.engine.logits.grammar import GrammarState
from mlx_dspark.engine.options import DEFAULT_OPTIONS, GenerationOptions, keyword_fields
from mlx_dspark.engine.prompt_cache import PromptCache
from mlx_dspark.engine.proposers.base import Proposer
from mlx_dspark.engine.round.results import GenerationResult, ResultCollector, StepResponse, length_histogram  # noqa: F401  (re-exported)
from mlx_dspark.engine.round.stops import StopReader
from mlx_dspark.engine.round.token_origins import TextOrigins, token_origins
from mlx_dspark.engine.round.request import compile_request, make_steps


def _with_option_keywords(function: Callable) -> Callable:
    """Show `function`'s `**option_keywords` as what they are: every generation option as a keyword-only
    parameter with its default (engine/options.py's `keyword_fields`), so `help()` and `inspect` list them."""
    signature = inspect.signature(function)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    at = [p.name for p in own].index("options") + 1  # the options right after `options=`, the object they make
    keywords = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=_annotation(f))
        for f in keyword_fields().values()
    ]
    function.__signature__ = signature.replace(parameters=own[:at] + keywords + own[at:])
    return function


def _annotation(field: dataclasses.Field) -> str:
    """The field's type, where None is accepted for an empty default (GenerationOptions.replace)."""
    return f"{field.type} | None" if field.default == () else str(field.type)


@_with_option_keywords
def stream_generate(
    model: Any,
    prompt: str | Sequence[int] | Sequence[dict],
    *,
    options: GenerationOptions | None = None,
    proposer: Proposer | None = None,
    prompt_cache: PromptCache | None = None,
    cancel: threading.Event | None = None,
    tools: Sequence[dict] | None = None,
    tool_choice: str | dict | ToolChoice | None = None,
    parallel_tool_calls: bool = True,
    **option_keywords: Any,
) -> Iterator[StepResponse]:
    """Yield a StepResponse per target forward; the last one carries the finish reason.

    The options come either whole as `options` (what the CLIs, the server and the benchmark pass) or
    as keywords, the documented front that builds the same object here, once; giving both is an
    error. Every field of `GenerationOptions`, `SamplingOptions` and `SpeculationOptions` (engine/options.py
    says what each does) is a keyword with the field's default; `stop` may be one string, `logit_bias` a
    {token id: bias} dict, and None for `stop`, `stop_token_ids` or `logit_bias` means none. A keyword that
    names no option is a TypeError naming it.
    `proposer` replaces the loaded draft (tests and benchmarks plug in controlled proposers).
    `prompt_cache` (from `make_prompt_cache`) keeps a conversation warm: the prompt's prefix that it
    already holds is not prefilled again (`cached_tokens`).
    The prompt plus `max_tokens` must fit in `max_context` (default: the target's
    `max_position_embeddings`): a `ContextLengthError` (a ValueError naming the numbers) before any
    model work otherwise. `cancel`, a `threading.Event` another thread may set, stops the generation
    between prefill chunks (of `prefill_step_size` tokens) or rounds: the stream raises
    `GenerationCancelled`.
    `max_draft_tokens="auto"` (the default) chooses each round's draft length from `cost_curve`, or else
    this machine's curve for the pair (measured once, cached on disk), and the acceptance seen so far,
    drafting nothing while no length pays (engine/policy/draft_length.py); an integer is a fixed cap.
    `verify_schedule="confidence"` needs a draft with a confidence head (an error otherwise) and uses
    `cost_curve`, or else this machine's curve for the pair (schedule.py: measured once, cached on disk).
    `tools` (OpenAI function tools) are rendered by the chat template; the last step of a chat prompt
    carries its text read as `content`, `reasoning` and `tool_calls` (the tokenizer's tool parser);
    `tool_choice` "required" or {"type": "function", "function": {"name": ...}} forces a call
    (constrained decoding), "none" offers no tools.
    `lookup` "on" adds prompt-lookup drafts beside the draft, "only" without it; `fast_forward` verifies
    a constraint's forced runs in the round's block (engine/policy/proposal_choice.py).
    `tree_nodes` > 0 verifies a best-first tree of that many draft nodes per round instead of a chain
    (engine/tree/rounds.py), "auto" the chain or tree size that pays most on this machine's cost curve
    (engine/tree/budget.py): greedy or sampled (lossless), with `lookup="off"`, a DSpark draft, an
    attention-only full-KV target and no logits processing; otherwise chain rounds run, with one
    `tree_fallback.EngineNote` warning naming why (engine/tree/fallback.py).
    """
    built = GenerationOptions.from_keywords(**option_keywords)  # a TypeError naming a keyword that is no option
    if options is None:
        options = built
    elif built != DEFAULT_OPTIONS:
        raise ValueError("give the generation options either as `options=` or as keywords, not both")
    setup = ToolSetup.of(tools, tool_choice, parallel=parallel_tool_calls)  # a ToolError (ValueError) naming the field
    forced = setup.constraint(model.tokenizer)
    if forced is not None:
        if options.constraint not in (None, forced):  # (the server's options already carry the forced call's)
            raise ValueError("tool_choice forces a tool call: it cannot be combined with constraint=")
        options = dataclasses.replace(options, constraint=forced)
    grammar = compile_request(model, options)  # here, not in the stream: a bad constraint fails at the call
    return _stream(model, prompt, options, proposer, prompt_cache, cancel, grammar, setup)


def stream_rounds(
    model: Any, prompt_ids: Sequence[int], rounds: Iterator[Round], *, options: GenerationOptions,
    prompt_cache: PromptCache | None = None, tools: ToolSetup | None = None, started: float | None = None,
) -> Iterator[StepResponse]:
    """StepResponses of rounds that another driver runs (the server's batch, `engine/batch/round.py`): the same
    stop tokens, stop strings, max_tokens and statistics as `stream_generate`. `options` are the row's;
    `tools` the request's (a single call allowed ends the answer on the token that completes it);
    `started` (a `time.perf_counter()`) is when the driver began its prompt, for `prompt_tps` (default: now)."""
    setup = tools if tools is not None else ToolSetup.of(None, None)
    return _stream(model, list(prompt_ids), options, None, prompt_cache, None, None, setup, rounds=rounds, started=started)


def _stream(
    model: Any,
    prompt: str | Sequence[int] | Sequence[dict],
    options: GenerationOptions,
    proposer: Proposer | None,
    prompt_cache: PromptCache | None,
    cancel: threading.Event | None,
    grammar: GrammarState | None,
    setup: ToolSetup,
    rounds: Iterator[Round] | None = None,
    started: float | None = None,
) -> Iterator[StepResponse]:
    start = time.perf_counter() if started is None else started  # the prompt's time counts from here
    tokenizer = model.tokenizer
    stop_ids = set(tokenizer.eos_token_ids) | set(options.stop_token_ids)
    prompt_ids = encode_prompt(tokenizer, prompt, chat_template_kwargs=options.chat_template_kwargs, tools=setup.offered)
    chat = not isinstance(prompt, str) and any(isinstance(m, dict) for m in prompt)
    reader = OutputCollector(setup.parser(tokenizer, prompt_ids)) if chat or setup.tools else None
    max_tokens = fit_max_tokens(len(prompt_ids), options, *context_length(model, options))
    if max_tokens != options.max_tokens:
        options = dataclasses.replace(options, max_tokens=max_tokens)

    if options.sampling.seed is not None and rounds is None:  # a batch row seeds its own draws
        mx.random.seed(options.sampling.seed)
    mx.reset_peak_memory()
    origins = TextOrigins()  # which characters the draft, a lookup or a grammar wrote (the server's marks)
    stops = StopReader(tokenizer.detokenizer, stop_ids=stop_ids, stops=options.stop, max_tokens=max_tokens,
                       reader=reader, origins=origins)
    emitted: list[int] = []
    first_token_time = None
    if rounds is None:
        rounds = make_steps(model, prompt_ids, options, proposer, prompt_cache, cancel, grammar)
    for step in rounds:
        now = time.perf_counter()
        if first_token_time is None:
            first_token_time = now
            cached = 0 if prompt_cache is None else prompt_cache.cached_tokens  # the resume just happened
        source = step.source if step.verified else None
        was_shown = stops.shown
        # one plain step per token: the round ends where plain decoding would have (stops.py)
        taken = stops.take(step.tokens, token_origins(len(step.tokens), step.accepted, source, step.verified))
        tokens, new_text, finish_reason = taken.tokens, taken.text, taken.finish_reason
        emitted += tokens
        if len(tokens) < len(step.tokens):
            _forget_past(rounds, prompt_cache, prompt_ids + emitted)
        generated = stops.generated
        elapsed = now - first_token_time
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
            marks=origins.runs(was_shown, stops.shown),
            source=source,
        )
        if finish_reason is not None:
            return


def _forget_past(rounds: Iterator[Round], prompt_cache: PromptCache | None, output: list[int]) -> None:
    """A round committed past the stop: end its step generator (so its draft context takes the positions it
    batches), then the caller's prompt cache forgets what it holds past `output` (prompt + emitted)."""
    if prompt_cache is None:
        return  # the step generator's own cache, dropped with it
    getattr(rounds, "close", lambda: None)()
    prompt_cache.forget_past(output)


def make_prompt_cache(
    model: Any, *, max_snapshots: int = 4, snapshot_margin: int = 16, max_rollback: int | None = None
) -> PromptCache:
    """A prompt cache for `model`'s target (and draft): pass it to every turn of one conversation.
    `max_rollback` (None: 8) bounds the lookup blocks (`lookup="on"`): give lookup.LOOKUP_MAX_TOKENS."""
    return PromptCache(model.target, model.draft, max_snapshots=max_snapshots, snapshot_margin=snapshot_margin,
                       max_rollback=max_rollback)


def generate(model: Any, prompt: str | Sequence[int] | Sequence[dict], **keywords: Any) -> GenerationResult:
    """Generate a whole completion: `stream_generate` with the same parameters (its signature, shown here
    too), joined."""
    collector = ResultCollector()
    for step in stream_generate(model, prompt, **keywords):
        collector.add(step)
    return collector.result()


generate.__signature__ = inspect.signature(stream_generate).replace(return_annotation="GenerationResult")
