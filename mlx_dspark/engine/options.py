"""Generation options: one frozen object, validated once when it is built.

The Python API, the generate CLI, the server and the benchmark all build a `GenerationOptions` and
pass it whole to `api.stream_generate`; nothing downstream re-checks a value. A bad value is an
`OptionError` (a `ValueError`) that names the field, the value and what is expected; its `field`
lets the CLIs name the flag and the server the request field.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from mlx_dspark.engine.logits.constraints import Constraint
from mlx_dspark.engine.policy.draft_length import AUTO
from mlx_dspark.engine.logits.sample import Sampler
from mlx_dspark.engine.costs.curve import VERIFY_SCHEDULES, CostCurve

DRAFT_SAMPLING_MODES = ("greedy", "sample")
# "off"; "on": lookup continuations beside the DSpark draft (alone when the model has none), the round
# verifies the better block (choose.py); "only": lookup alone, the draft left unused
LOOKUP_MODES = ("off", "on", "only")
PREFILL_STEP_SIZE = 512  # prompt tokens per prefill forward: bounds the memory of long prompts
SEED_MAX = 2**64 - 1  # MLX seeds its generator with an unsigned 64-bit integer
MAX_LOGPROBS = 20  # the most alternatives a step reports per token (OpenAI's top_logprobs limit)
MAX_TREE_NODES = 64  # the most draft nodes one tree round verifies


class OptionError(ValueError):
    """A generation option with a value we cannot use."""

    def __init__(self, field: str, value: Any, expected: str) -> None:
        super().__init__(f"{field} must be {expected}, got {value!r}")
        self.field = field


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_fraction(field: str, value: Any) -> None:
    if not (_is_number(value) and 0.0 <= value <= 1.0):
        raise OptionError(field, value, "a number in [0, 1]")


@dataclass(frozen=True)
class SamplingOptions(Sampler):
    """The target distribution's knobs (this is the `Sampler` the loops use) and the seed of MLX's generator.

    `temperature == 0` is greedy decoding; `seed=None` leaves the generator as it is.
    The penalties and `logit_bias` change the target's logits before temperature and the filters
    (logits_processing.py: llama.cpp / mlx-lm meanings); they look at the last `penalty_last_n` tokens of
    the whole sequence, prompt tokens included (as llama-server does); 0 turns them off.
    """

    seed: int | None = None
    presence_penalty: float = 0.0  # minus this for every token present in the window (OpenAI's, in [-2, 2])
    frequency_penalty: float = 0.0  # minus this times the token's count in the window (OpenAI's, in [-2, 2])
    repetition_penalty: float = 1.0  # a present token's logit divided by it (times it when negative); 1 disables
    penalty_last_n: int = 64  # how many of the most recent tokens the penalties look at
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit); a dict is accepted

    def __post_init__(self) -> None:
        if not (_is_number(self.temperature) and self.temperature >= 0):
            raise OptionError("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise OptionError("top_p", self.top_p, "a number in (0, 1] (1 disables it)")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise OptionError("top_k", self.top_k, "an integer >= 0 (0 disables it)")
        if not (_is_number(self.min_p) and 0.0 <= self.min_p < 1.0):
            raise OptionError("min_p", self.min_p, "a number in [0, 1) (0 disables it)")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed <= SEED_MAX):
            raise OptionError("seed", self.seed, "an integer in [0, 2**64 - 1], or none for an unseeded run")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (_is_number(getattr(self, name)) and -2.0 <= getattr(self, name) <= 2.0):
                raise OptionError(name, getattr(self, name), "a number in [-2, 2] (0 disables it)")
        if not (_is_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise OptionError("repetition_penalty", self.repetition_penalty, "a number > 0 (1 disables it)")
        if not (_is_int(self.penalty_last_n) and self.penalty_last_n >= 0):
            raise OptionError("penalty_last_n", self.penalty_last_n, "an integer >= 0 (0 turns the penalties off)")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def has_penalties(self) -> bool:
        active = self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        return active and self.penalty_last_n > 0


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A {token id: bias} mapping or (id, bias) pairs -> sorted pairs; ids may be digit strings (JSON keys)."""
    expected = "a mapping of token ids (integers >= 0) to biases (numbers in [-100, 100])"
    pairs = value.items() if isinstance(value, Mapping) else value
    if not isinstance(pairs, (list, tuple)) and not isinstance(value, Mapping):
        raise OptionError("logit_bias", value, expected)
    out: dict[int, float] = {}
    for item in pairs:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise OptionError("logit_bias", value, expected)
        token, bias = item
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        if not (isinstance(token, numbers.Integral) and not isinstance(token, bool) and token >= 0):
            raise OptionError("logit_bias", value, f"{expected}; bad token id {token!r}")
        if not (_is_number(bias) and -100.0 <= bias <= 100.0):
            raise OptionError("logit_bias", value, f"{expected}; bad bias {bias!r} for token {token}")
        out[int(token)] = float(bias)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SpeculationOptions:
    """How the draft proposes and how much of a proposal the round verifies."""

    speculative: bool = True  # False: plain decoding with the target alone (the baseline)
    draft_sampling: str = "greedy"  # how the draft proposes when the target samples
    p_min: float = 0.0  # stop a proposal before the first position whose top draft probability is below it
    confidence_threshold: float = 0.0  # stop before the first token whose confidence is below it
    # The most draft tokens one round verifies: "auto" (draft_length.py: chosen live from this machine's cost
    # curve and the acceptance seen, 0 where nothing pays), a fixed cap, or None for the block size
    max_draft_tokens: int | str | None = AUTO
    # "fixed": verify every proposed draft (after the cuts above); "confidence": also stop where the expected
    # tokens per second stop rising (schedule.py), by the draft's confidences and the machine's cost curve
    verify_schedule: str = "fixed"
    cost_curve: CostCurve | None = None  # for "confidence" and "auto"; None = this machine's, measured once and cached
    # With a constraint: the draft proposes from its grammar-masked distribution (True; one host read per
    # draft position) or unmasked, its proposal cut at the first token the grammar forbids (False), or
    # per round the faster of the two as measured during the request ("auto", mask_choice.py)
    mask_draft: bool | str = True
    # Prompt lookup (lookup.py, choose.py): propose what followed the last tokens earlier in the context;
    # on by default (lossless, and never more target forwards than the draft alone on benchmarks/workloads)
    lookup: str = "on"
    # With a constraint: verify the grammar's forced runs (its only continuation) in the round's block
    fast_forward: bool = True
    # Tree rounds (tree_steps.py): verify a best-first tree of at most this many draft nodes per round, or
    # "auto" (tree_budget.py: per round the top chain or a tree of the size that pays most on this machine's
    # cost curve, no draft where none does); 0: chain rounds. Where a tree cannot run (lookup on, logits
    # processing, a chain-round cut, a draft or target trees do not fit) the request runs chain rounds and
    # says why once (tree_fallback.py)
    tree_nodes: int | str = 0

    def __post_init__(self) -> None:
        if not isinstance(self.speculative, bool):
            raise OptionError("speculative", self.speculative, "true or false")
        if self.lookup not in LOOKUP_MODES:
            raise OptionError("lookup", self.lookup, f"one of {', '.join(LOOKUP_MODES)}")
        if not isinstance(self.fast_forward, bool):
            raise OptionError("fast_forward", self.fast_forward, "true or false")
        if self.draft_sampling not in DRAFT_SAMPLING_MODES:
            raise OptionError("draft_sampling", self.draft_sampling, f"one of {', '.join(DRAFT_SAMPLING_MODES)}")
        _check_fraction("p_min", self.p_min)
        _check_fraction("confidence_threshold", self.confidence_threshold)
        if self.max_draft_tokens not in (None, AUTO) and not (_is_int(self.max_draft_tokens) and self.max_draft_tokens >= 1):
            raise OptionError(
                "max_draft_tokens", self.max_draft_tokens, f"{AUTO!r}, an integer >= 1, or none for the draft's block size"
            )
        if not (isinstance(self.mask_draft, bool) or self.mask_draft == "auto"):
            raise OptionError("mask_draft", self.mask_draft, "true, false or \"auto\"")
        if self.verify_schedule not in VERIFY_SCHEDULES:
            raise OptionError("verify_schedule", self.verify_schedule, f"one of {', '.join(VERIFY_SCHEDULES)}")
        if self.cost_curve is not None and not isinstance(self.cost_curve, CostCurve):
            raise OptionError("cost_curve", self.cost_curve, "a schedule.CostCurve, or none for this machine's")
        if not (self.tree_nodes == AUTO or (_is_int(self.tree_nodes) and 0 <= self.tree_nodes <= MAX_TREE_NODES)):
            raise OptionError("tree_nodes", self.tree_nodes, f"an integer in [0, {MAX_TREE_NODES}] (0: chain rounds) or {AUTO!r}")

    @property
    def auto_length(self) -> bool:
        return self.max_draft_tokens == AUTO

    def draft_length(self, block_size: int) -> int:
        """Draft tokens one round proposes at most, for a draft of `block_size` tokens per block (auto: its cap)."""
        if self.auto_length:
            return block_size  # auto stays within the widths its cost curve covers
        if self.max_draft_tokens is not None and self.max_draft_tokens > block_size:
            raise OptionError("max_draft_tokens", self.max_draft_tokens, f"at most the draft's block size {block_size}")
        length = self.max_draft_tokens or block_size
        curve = self.cost_curve
        if self.verify_schedule == "confidence" and curve is not None and curve.max_width < length + 1:
            raise OptionError("cost_curve", f"{curve.source} (widths 1..{curve.max_width})", f"verify costs for widths 1..{length + 1}")
        return length


@dataclass(frozen=True)
class GenerationOptions:
    """Everything one generation request sets, beside the prompt and the model."""

    max_tokens: int = 256
    # True: max_tokens is a default the caller did not choose (a server request without one): a prompt
    # that leaves less room in the context shortens it to the room left, as OpenAI does; False: a prompt
    # plus max_tokens over the context is refused
    clamp_max_tokens: bool = False
    # The tokens the prompt and the completion must fit in; None: the target's max_position_embeddings
    max_context: int | None = None
    prefill_step_size: int = PREFILL_STEP_SIZE  # prompt tokens per prefill forward (cancellation is checked between them)
    stop: tuple[str, ...] = ()  # stop strings; a single string is accepted too
    stop_token_ids: tuple[int, ...] = ()  # stop tokens beside the tokenizer's end-of-sequence ids
    chat_template_kwargs: Mapping[str, Any] | None = None  # switches for the chat template
    sampling: SamplingOptions = SamplingOptions()
    speculation: SpeculationOptions = SpeculationOptions()
    # None: off; 0..20: each committed token's log-probability and that many top alternatives (logprobs.py)
    logprobs: int | None = None
    constraint: Constraint | None = None  # the output must match it (constraints.py); compiled per request

    def __post_init__(self) -> None:
        if not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise OptionError("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.clamp_max_tokens, bool):
            raise OptionError("clamp_max_tokens", self.clamp_max_tokens, "true or false")
        if self.max_context is not None and not (_is_int(self.max_context) and self.max_context >= 2):
            raise OptionError(
                "max_context", self.max_context, "an integer >= 2 (a prompt token and a generated one), or none for the model's"
            )
        if not (_is_int(self.prefill_step_size) and self.prefill_step_size >= 1):
            raise OptionError("prefill_step_size", self.prefill_step_size, "an integer >= 1")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
            raise OptionError("stop", self.stop, "a string or a list of strings")
        ids = self.stop_token_ids
        # Integral, not int: token ids often come out of numpy or mlx arrays.
        if not (isinstance(ids, (list, tuple)) and all(isinstance(t, numbers.Integral) and t >= 0 for t in ids)):
            raise OptionError("stop_token_ids", ids, "a list of token ids (integers >= 0)")
        kwargs = self.chat_template_kwargs
        if kwargs is not None and not (isinstance(kwargs, Mapping) and all(isinstance(k, str) for k in kwargs)):
            raise OptionError("chat_template_kwargs", kwargs, "a mapping of names to values")
        if not isinstance(self.sampling, SamplingOptions):
            raise OptionError("sampling", self.sampling, "a SamplingOptions")
        if not isinstance(self.speculation, SpeculationOptions):
            raise OptionError("speculation", self.speculation, "a SpeculationOptions")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise OptionError("logprobs", self.logprobs, f"an integer in [0, {MAX_LOGPROBS}], or none to turn them off")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise OptionError("constraint", self.constraint, "a constraints.Constraint (Constraint.json_schema(...), .regex(...), ...)")
        # Stored as tuples (empty stop strings dropped) and a copied dict, so the object cannot change later.
        object.__setattr__(self, "stop", tuple(s for s in stop if s))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        object.__setattr__(self, "chat_template_kwargs", None if kwargs is None else dict(kwargs))

    @classmethod
    def from_keywords(cls, **keywords: Any) -> GenerationOptions:
        """The options that flat keywords set (the API's front: `temperature=`, `lookup=`, ...), the rest default."""
        return cls().replace(**keywords)

    def replace(self, **keywords: Any) -> GenerationOptions:
        """A copy with the options that flat keywords name changed (see `keyword_fields`).

        None for a field whose default is empty (`stop`, `stop_token_ids`, `logit_bias`) means empty. A
        keyword that names no option is a TypeError naming it.
        """
        known = keyword_fields()
        for name in keywords:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(f"unexpected keyword argument {name!r}: no generation option has that name{hint}")
        values = {name: () if value is None and known[name].default == () else value for name, value in keywords.items()}
        for field in dataclasses.fields(self):
            if dataclasses.is_dataclass(field.default):  # a group (sampling, speculation): its fields are keywords
                group = getattr(self, field.name)
                changes = {f.name: values.pop(f.name) for f in dataclasses.fields(group) if f.name in values}
                if changes:
                    values[field.name] = dataclasses.replace(group, **changes)
        return dataclasses.replace(self, **values)


@functools.cache
def keyword_fields() -> dict[str, dataclasses.Field]:
    """Every generation option as one flat keyword, by name, in declaration order: GenerationOptions' fields,
    its groups (`sampling`, `speculation`) opened into theirs. A new field here is a new API keyword."""
    flat: dict[str, dataclasses.Field] = {}
    for field in dataclasses.fields(GenerationOptions):
        group = field.default
        for option in dataclasses.fields(group) if dataclasses.is_dataclass(group) else (field,):
            assert option.name not in flat, f"two generation options are named {option.name!r}"
            flat[option.name] = option
    return flat


DEFAULT_OPTIONS = GenerationOptions()
