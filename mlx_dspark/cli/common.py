"""What the command lines share: the generation flags, their errors as one line, the demo pair.

`generate`, `server` and `benchmark` declare the flags below (names, aliases and help written once
here) under the same parameter names, and `generation_options(ctx.params, ...)` builds their one
`GenerationOptions`; inside `flag_errors()` a bad value is `error: --flag: ...` and exit status 2.
Without `--model` they run the trained demo pair shipped in the package (`demo_pair()`).
llama-server's names for the model card's recipe (`--spec-draft-n-max`, `--spec-draft-p-min`,
`--spec-draft-sampling`) are aliases, with llama-server's meanings (`--spec-draft-p-min` is the
confidence threshold, as upstream reads it for DSpark drafts). `--model` / `--draft` take what `load()` takes (directories, repo
ids, `.gguf` files, `owner/name:FILE.gguf`); `--draft-tap-ids` overrides a draft's tapped layers.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Iterator, Mapping, Optional

import typer

from mlx_dspark.loading.heads import draft_help
from mlx_dspark.cli.demo import DEMO_PROMPT, demo_pair  # noqa: F401  (re-exported: the commands' default)
from mlx_dspark.engine.logits.constraints import Constraint, ConstraintError
from mlx_dspark.engine.policy.draft_length import AUTO
from mlx_dspark.engine.options import (
    DEFAULT_OPTIONS,
    DRAFT_SAMPLING_MODES,
    LOOKUP_MODES,
    MAX_TREE_NODES,
    GenerationOptions,
    OptionError,
)
from mlx_dspark.loading.precision import Q_BITS
from mlx_dspark.engine.costs.curve import CostCurve
from mlx_dspark.cli.errors import exit_on_interrupt, fail, load_errors  # noqa: F401  (re-exported)

# The flags' defaults are the options' own.
SAMPLING, SPECULATION = DEFAULT_OPTIONS.sampling, DEFAULT_OPTIONS.speculation


# The flag that sets each option field, for error lines (a command may name max_tokens differently).
FLAGS = {
    "max_tokens": "--max-tokens",
    "max_context": "--max-context",
    "temperature": "--temp",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "seed": "--seed",
    "draft_sampling": "--draft-sampling",
    "p_min": "--p-min",
    "confidence_threshold": "--confidence-threshold",
    "max_draft_tokens": "--max-draft-tokens",
    "verify_schedule": "--verify-schedule",
    "cost_curve": "--cost-curve-file",
    "chat_template_kwargs": "--chat-template-args",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "repetition_penalty": "--repetition-penalty",
    "penalty_last_n": "--penalty-last-n",
    "logit_bias": "--logit-bias",
    "mask_draft": "--no-mask-draft",
    "lookup": "--lookup",
    "fast_forward": "--no-fast-forward",
    "tree_nodes": "--tree-nodes",
}
CONSTRAINT_FLAGS = {"json_schema": "--json-schema", "regex": "--regex", "grammar": "--grammar", "tokenizer": "--model"}

Temp = Annotated[float, typer.Option("--temp", "--temperature", help="Sampling temperature (0 = greedy).")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1] (1 = off).")]
TopK = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens below min-p times the top probability (0 = off).")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Seed of MLX's generator, in [0, 2**64 - 1].")]
DraftSampling = Annotated[
    str,
    typer.Option(
        "--draft-sampling", "--spec-draft-sampling", help=f"How the draft proposes: {' or '.join(DRAFT_SAMPLING_MODES)}."
    ),
]
PMin = Annotated[
    float, typer.Option("--p-min", help="Stop a proposal before the first draft token below this probability.")
]
# llama-server's --spec-draft-p-min is, for DSpark drafts, a threshold on the confidence head (common/speculative.cpp)
ConfidenceThreshold = Annotated[
    float,
    typer.Option(
        "--confidence-threshold",
        "--spec-draft-p-min",
        help="Stop a proposal before the first token whose confidence is below this (llama-server's --spec-draft-p-min "
        "for DSpark drafts; needs a draft with a confidence head when > 0).",
    ),
]
MaxDraftTokens = Annotated[
    Optional[str],
    typer.Option(
        "--max-draft-tokens", "--spec-draft-n-max", "--num-draft-tokens",
        help="Draft tokens per round: auto (the default: chosen each few rounds from this machine's measured costs and the "
        "acceptance seen, none while drafting does not pay) or N, a fixed cap (the model card's is the block size, 7; mlx-lm's --num-draft-tokens).",
    ),
]
VerifySchedule = Annotated[
    str,
    typer.Option(
        "--verify-schedule",
        help="fixed: verify every proposed draft; confidence: stop where the expected tokens/s stop rising "
        "(needs a draft with a confidence head; uses --cost-curve-file or this machine's curve, measured once and cached).",
    ),
]
CostCurveFile = Annotated[
    Optional[Path],
    typer.Option("--cost-curve-file", help="cost_curve.json from `python -m mlx_dspark.benchmark --cost-curve` for --verify-schedule confidence."),
]
NoDraft = Annotated[bool, typer.Option("--no-draft", help="Plain target decoding (the baseline).")]
# `--draft lookup`: no DSpark draft, prompt-lookup drafts alone (any target gets some speedup on text
# that repeats its context); `--lookup on` (the default) adds them beside a DSpark draft
LOOKUP_DRAFT = "lookup"
Lookup = Annotated[
    str,
    typer.Option(
        "--lookup",
        help=f"Prompt-lookup drafts: {' | '.join(LOOKUP_MODES)}. on: beside the DSpark draft, the round verifies the "
        "better block (the default); off: DSpark blocks only; only: without the draft (as --draft lookup).",
    ),
]
TreeNodes = Annotated[
    Optional[str],
    typer.Option(
        "--tree-nodes",
        help="Verify a token tree per round instead of a chain: N draft nodes (1..64), or auto (per round the chain or "
        "the tree size of the most expected tokens per ms on this machine's cost curve, no draft where none pays); "
        "with --lookup off, a DSpark draft and an attention-only target, greedy or sampled; with penalties, logit "
        "bias, a constraint, logprobs, lookup on or another draft or target the rounds are chains and a note says "
        "why [default: 0, chain rounds].",
    ),
]
NoFastForward = Annotated[
    bool, typer.Option("--no-fast-forward", help="With a constraint: do not verify the grammar's forced runs in the round's block.")
]
ChatTemplateArgs = Annotated[
    Optional[str],
    typer.Option("--chat-template-args", help="JSON object for the chat template, e.g. '{\"enable_thinking\": false}'."),
]
MaxContext = Annotated[
    Optional[int],
    typer.Option(
        "--max-context",
        help="Tokens the prompt and the completion must fit in (default: the target's max_position_embeddings).",
    ),
]
PresencePenalty = Annotated[
    float, typer.Option("--presence-penalty", help="Subtract from the logit of every token seen in the last --penalty-last-n, in [-2, 2].")
]
FrequencyPenalty = Annotated[
    float, typer.Option("--frequency-penalty", help="Subtract this times the token's count in the last --penalty-last-n, in [-2, 2].")
]
RepetitionPenalty = Annotated[
    float, typer.Option("--repetition-penalty", help="Divide a seen token's logit by this (mlx-lm / llama.cpp; 1 = off).")
]
PenaltyLastN = Annotated[
    int, typer.Option("--penalty-last-n", help="How many recent tokens (prompt included) the penalties look at; 0 = off.")
]
LogitBias = Annotated[
    Optional[str],
    typer.Option("--logit-bias", help="Token biases as JSON ('{\"42\": -100}') or ID:BIAS pairs ('42:-100,7:2.5')."),
]
JsonSchema = Annotated[Optional[Path], typer.Option("--json-schema", help="Constrain the output to this JSON Schema file.")]
Regex = Annotated[Optional[str], typer.Option("--regex", help="Constrain the whole output to match this regex.")]
Grammar = Annotated[
    Optional[Path], typer.Option("--grammar", help="Constrain the output to this grammar file (llguidance Lark, or llama.cpp GBNF).")
]
NoMaskDraft = Annotated[
    bool, typer.Option("--no-mask-draft", help="With a constraint: let the draft propose unmasked (cut at its first forbidden token).")
]
Quantize = Annotated[Optional[int], typer.Option("--quantize", help="Quantize the target at load time: 4 or 8 bits.")]
DraftQuantize = Annotated[
    Optional[int],
    typer.Option("--draft-quantize", help="The draft's own precision at load time: 4 or 8 bits, or 0 to keep it in float beside a --quantize'd target (default: as --quantize)."),
]
DraftDtype = Annotated[Optional[str], typer.Option("--draft-dtype", help="The draft's floating dtype (float32, bfloat16, float16), replacing the target's.")]
DraftVocab = Annotated[
    Optional[int],
    typer.Option("--draft-vocab", help="Draft over the K most frequent tokens only (FR-Spec), ranked by --draft-vocab-file or the draft's vocab_rank.json; lossless."),
]
DraftVocabFile = Annotated[Optional[Path], typer.Option("--draft-vocab-file", help="Token ranking from `python -m mlx_dspark.rank_vocab`, for --draft-vocab.")]
KvBits = Annotated[Optional[int], typer.Option("--kv-bits", help="Quantize the target's full-attention KV caches: 4 or 8 bits (changes the target's numerics).")]
MODEL_HELP = "Target: local directory, Hugging Face repo id, FILE.gguf, or owner/name:FILE.gguf."
DRAFT_HELP = draft_help()
DraftTapIds = Annotated[
    Optional[str],
    typer.Option(
        "--draft-tap-ids",
        help="The target layers the draft reads, as Hugging Face layer ids (e.g. 2,10,18,25,33), replacing the draft's "
        "own; for GGUF drafts from converters that wrote target_layers without upstream's +1.",
    ),
]


@contextmanager
def flag_errors(flags: Mapping[str, str] = FLAGS) -> Iterator[None]:
    """A ValueError inside becomes one error line; an OptionError names the flag that set the field."""
    try:
        yield
    except OptionError as err:
        flag = flags.get(err.field)
        fail(f"{flag}: {err}" if flag else str(err))
    except ConstraintError as err:
        flag = CONSTRAINT_FLAGS.get(err.field)
        fail(f"{flag}: {err}" if flag else str(err))
    except ValueError as err:
        fail(str(err))


def resolve_draft(model: Optional[str], draft: Optional[str], *, no_draft: bool, serve: bool = False, verb: str = "serving",
                  **hub: Any) -> Optional[str]:
    """`--draft auto` (and with `serve`, as the server, generate and chat run: no --draft with a --model): the
    known draft of the target, said on stderr; an unknown target is one error line for `auto`, plain
    decoding said on stderr ("{verb} without a draft") otherwise. `hub`: the Hub calls replaced (tests)."""
    from mlx_dspark.loading import draft_registry

    wanted = draft == draft_registry.AUTO or (serve and draft is None)
    if no_draft or model is None or not wanted:
        return None if draft == draft_registry.AUTO else draft
    hub.setdefault("fetch_config", draft_registry.hub_config)
    hub.setdefault("download", draft_registry.hub_download)
    try:
        reference, line = draft_registry.resolve_auto_draft(model, **hub)
    except FileNotFoundError as err:
        if draft == draft_registry.AUTO:
            fail(str(err))
        reference, line = None, str(err)  # the server's own choice: it still serves, plainly
    if reference is None and draft == draft_registry.AUTO:
        fail(f"--draft auto: {line}")
    typer.echo(f"[mlx_dspark] {line if reference else f'{verb} without a draft: ' + line}", err=True)
    return reference


def lookup_alone(ctx: typer.Context) -> bool:
    """`--no-draft --lookup on|only` named on the command line: prompt-lookup drafts alone (as `--draft
    lookup`), not the plain baseline `--no-draft` means by itself; said on stderr, `ctx.params` rewritten."""
    params = ctx.params
    named = getattr(ctx.get_parameter_source("lookup"), "name", None) == "COMMANDLINE"
    if not (params.get("no_draft") and params.get("lookup", "off") != "off" and named):
        return False
    typer.echo(f"[mlx_dspark] --no-draft --lookup {params['lookup']}: no DSpark draft, prompt-lookup drafts alone", err=True)
    params.update(no_draft=False, draft=LOOKUP_DRAFT)
    return True


def text_flag(flag: str, value: str) -> str:
    """A text flag's value, refused when it is not valid Unicode (argv bytes that are not UTF-8 arrive
    as lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{flag} is not valid UTF-8 text (an undecodable byte or lone surrogate at character {err.start})"
        ) from None
    return value


def generation_options(flags: Mapping[str, Any], *, max_tokens: int) -> GenerationOptions:
    """The options a command's parsed flags (its `ctx.params`) set, by the parameter names above.

    `seed`, `no_draft`, `chat_template_args`, `verify_schedule`, `cost_curve_file` and `max_context` are
    optional: a command without them gets the defaults.
    """
    curve_file = flags.get("cost_curve_file")  # a bad file is a ValueError naming it
    cost_curve = None if curve_file is None else CostCurve.from_file(curve_file)
    return GenerationOptions.from_keywords(
        max_tokens=max_tokens,
        max_context=flags.get("max_context"),
        chat_template_kwargs=parse_template_args(flags.get("chat_template_args")),
        temperature=flags["temp"],
        top_p=flags["top_p"],
        top_k=flags["top_k"],
        min_p=flags["min_p"],
        seed=flags.get("seed", SAMPLING.seed),
        presence_penalty=flags.get("presence_penalty", SAMPLING.presence_penalty),
        frequency_penalty=flags.get("frequency_penalty", SAMPLING.frequency_penalty),
        repetition_penalty=flags.get("repetition_penalty", SAMPLING.repetition_penalty),
        penalty_last_n=flags.get("penalty_last_n", SAMPLING.penalty_last_n),
        logit_bias=parse_logit_bias(flags.get("logit_bias")),
        constraint=constraint_from_flags(flags),
        speculative=not flags.get("no_draft", False),
        draft_sampling=flags["draft_sampling"],
        p_min=flags["p_min"],
        confidence_threshold=flags["confidence_threshold"],
        max_draft_tokens=parse_auto(flags["max_draft_tokens"], field="max_draft_tokens", absent=AUTO,
                                    expected=f"{AUTO!r} or an integer >= 1"),
        verify_schedule=flags.get("verify_schedule", SPECULATION.verify_schedule),
        cost_curve=cost_curve,
        mask_draft=not flags.get("no_mask_draft", False),
        lookup=lookup_mode(flags),
        fast_forward=not flags.get("no_fast_forward", False),
        tree_nodes=parse_auto(flags.get("tree_nodes"), field="tree_nodes", absent=0,
                              expected=f"{AUTO!r} or an integer in [0, {MAX_TREE_NODES}]"),
    )


def lookup_mode(flags: Mapping[str, Any]) -> str:
    """--lookup, where `--draft lookup` (no DSpark draft) turns "off" into "on"."""
    mode = flags.get("lookup", SPECULATION.lookup)
    return "on" if flags.get("draft") == LOOKUP_DRAFT and mode == "off" else mode


def draft_path(draft: Optional[str]) -> Optional[str]:
    """The --draft to load: none for `--draft lookup`."""
    return None if draft == LOOKUP_DRAFT else draft


def parse_auto(text: Optional[str], *, field: str, absent: int | str, expected: str) -> int | str:
    """--max-draft-tokens, --tree-nodes: "auto" or an integer (checked by SpeculationOptions); `absent` if not given."""
    if text is None or text == AUTO:
        return absent if text is None else text
    try:
        return int(text)
    except ValueError:
        raise OptionError(field, text, expected) from None


def parse_logit_bias(text: Optional[str]) -> dict:
    """--logit-bias as a JSON object or ID:BIAS pairs; the values are checked by SamplingOptions."""
    if not text:
        return {}
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise OptionError("logit_bias", text, f"a JSON object of token ids to biases ({err})") from None
        if not isinstance(value, dict):
            raise OptionError("logit_bias", text, "a JSON object of token ids to biases")
        return value
    out = {}
    for pair in text.split(","):
        token, sep, bias = pair.strip().partition(":")
        try:
            out[int(token)] = float(bias)
        except ValueError:
            raise OptionError("logit_bias", text, "ID:BIAS pairs separated by commas, e.g. 42:-100,7:2.5") from None
    return out


def constraint_from_flags(flags: Mapping[str, Any]) -> Optional[Constraint]:
    """--json-schema FILE, --regex or --grammar FILE (at most one), as a Constraint."""
    given = [name for name in ("json_schema", "regex", "grammar") if flags.get(name) is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of {', '.join(CONSTRAINT_FLAGS[name] for name in given)}")
    if not given:
        return None
    name = given[0]
    if name == "regex":
        return Constraint.regex(text_flag("--regex", flags["regex"]))
    path = Path(flags[name])
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{CONSTRAINT_FLAGS[name]}: cannot read {path}: {err}") from None
    try:
        return Constraint.json_schema(text) if name == "json_schema" else Constraint.grammar(text)
    except ConstraintError as err:
        raise ConstraintError(err.field, f"{path}: {str(err).split(': ', 1)[-1]}") from None


def needs_cost_curve(options: GenerationOptions) -> bool:
    """Whether the options read a cost curve: `--max-draft-tokens auto` or `--verify-schedule confidence`."""
    speculation = options.speculation
    return speculation.speculative and (speculation.auto_length or speculation.verify_schedule == "confidence")


def resolve_cost_curve(pair: Any, options: GenerationOptions) -> GenerationOptions:
    """For auto draft lengths or --verify-schedule confidence: fix the cost curve now (the --cost-curve-file
    one, else this machine's: cached, or measured once here rather than in a request); the confidence
    schedule also checks that the draft has a confidence head."""
    from mlx_dspark.engine.costs.probe import cost_curve_for
    from mlx_dspark.engine.costs.curve import require_confidence_head

    speculation = options.speculation
    if speculation.verify_schedule == "confidence":
        require_confidence_head(pair.draft, source=pair.draft_path)
    curve = speculation.cost_curve or cost_curve_for(pair)
    speculation.draft_length(int(pair.draft.num_drafts))
    return options.replace(cost_curve=curve)


def parse_template_args(text: Optional[str]) -> Optional[dict]:
    """`--chat-template-args`: a JSON object, or None when the flag is absent."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--chat-template-args is not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(value, dict):
        raise ValueError("--chat-template-args must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


def parse_tap_ids(text: Optional[str], *, draft: Optional[str], model: Optional[str]) -> Optional[list[int]]:
    """`--draft-tap-ids`: comma-separated layer ids, or None when the flag is absent. It needs a draft
    (the demo pair's, without --model)."""
    if text is None:
        return None
    if draft is None and model is not None:
        raise ValueError("--draft-tap-ids applies to a draft: pass --draft as well")
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--draft-tap-ids expects comma-separated layer ids, e.g. 2,10,18,25,33; got {text!r}") from None
    if not ids:
        raise ValueError(f"--draft-tap-ids expects at least one layer id, e.g. 2,10,18,25,33; got {text!r}")
    return ids


def draft_load_options(flags: Mapping[str, Any], *, speculative: bool = True) -> dict[str, Any]:
    """load()'s precision / vocabulary / KV keywords from a command's parsed flags, checked before the load.

    Without a draft (`speculative=False`) the draft's flags are dropped: --no-draft runs the target alone."""
    from mlx_dspark.loading.precision import DTYPES
    from mlx_dspark.models.caches.kv import KV_BITS

    quantize, dtype = flags.get("draft_quantize"), flags.get("draft_dtype")
    vocab, vocab_file, kv_bits = flags.get("draft_vocab"), flags.get("draft_vocab_file"), flags.get("kv_bits")
    if quantize is not None and quantize != 0 and quantize not in Q_BITS:
        raise ValueError(f"--draft-quantize must be 0 (float) or one of {', '.join(map(str, Q_BITS))}, got {quantize}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--draft-dtype must be one of {', '.join(sorted(DTYPES))}, got {dtype!r}")
    if vocab is not None and vocab < 1:
        raise ValueError(f"--draft-vocab must be an integer >= 1 (tokens the draft scores), got {vocab}")
    if vocab_file is not None and vocab is None:
        raise ValueError("--draft-vocab-file needs --draft-vocab K (how many of its ranked tokens the draft scores)")
    if kv_bits is not None and kv_bits not in KV_BITS:
        raise ValueError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}, got {kv_bits}")
    options: dict[str, Any] = {"kv_bits": kv_bits}
    if speculative:
        options.update(draft_quantize=quantize, draft_dtype=dtype, draft_vocab=vocab, draft_vocab_file=vocab_file)
    return {k: v for k, v in options.items() if v is not None}


def check_quantize(bits: Optional[int]) -> None:
    """`--quantize`, checked before the (slow) load with the loader's own list of bit widths."""
    if bits is not None and bits not in Q_BITS:
        raise ValueError(f"--quantize must be one of {', '.join(map(str, Q_BITS))}, got {bits}")
