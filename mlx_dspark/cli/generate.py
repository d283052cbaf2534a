"""The generate command line: parses flags, loads the pair, streams text to stdout.

With no `--model`, it runs the trained demo pair shipped in the package (`cli_common.demo_pair`: a small
Python-code target and its DSpark draft), on a Python prompt unless `--prompt` says otherwise. Errors a
user can fix are one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Optional

import typer

from mlx_dspark.cli import common as flags
from mlx_dspark.cli.common import exit_on_interrupt, fail, flag_errors, needs_cost_curve, resolve_cost_curve
from mlx_dspark.cli.demo import raw_text_prompts
from mlx_dspark.cli.errors import notes_as_lines
from mlx_dspark.cli.split import PIPELINE_HELP, launched_group, split_or_follow, target_splitter

app = typer.Typer(add_completion=False, help="Generate text with a target and its DSpark draft.")

DEFAULT_PROMPT = "Write a short poem about the sea."  # with --model; the demo pair has its own


def read_prompt(prompt: str) -> str:
    """The --prompt text, or standard input for "-", as valid UTF-8 (else a ValueError naming the byte)."""
    if prompt != "-":
        return flags.text_flag("--prompt", prompt)
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--prompt -: standard input is not valid UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start}); "
            "convert it first, e.g. with iconv"
        ) from None


@app.command()
@exit_on_interrupt()
def generate(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", help=flags.MODEL_HELP),
    draft: Optional[str] = typer.Option(None, "--draft", "--draft-model", help=flags.DRAFT_HELP),
    draft_tap_ids: flags.DraftTapIds = None,
    prompt: Optional[str] = typer.Option(
        None, "--prompt", "-p",
        help=f"Prompt text, or - for stdin [default: {DEFAULT_PROMPT!r}; without --model, {flags.DEMO_PROMPT!r}]",
    ),  # fmt: skip
    system: Optional[str] = typer.Option(None, "--system", help="System message for the chat template."),
    max_tokens: Optional[int] = typer.Option(
        None, "--max-tokens", "-m",
        help=f"The most tokens to generate [default: {flags.DEFAULT_OPTIONS.max_tokens}, or what the context has left].",
    ),  # fmt: skip
    temp: flags.Temp = flags.SAMPLING.temperature,
    top_p: flags.TopP = flags.SAMPLING.top_p,
    top_k: flags.TopK = flags.SAMPLING.top_k,
    min_p: flags.MinP = flags.SAMPLING.min_p,
    seed: flags.Seed = flags.SAMPLING.seed,
    draft_sampling: flags.DraftSampling = flags.SPECULATION.draft_sampling,
    no_draft: flags.NoDraft = False,
    confidence_threshold: flags.ConfidenceThreshold = flags.SPECULATION.confidence_threshold,
    p_min: flags.PMin = flags.SPECULATION.p_min,
    max_draft_tokens: flags.MaxDraftTokens = flags.SPECULATION.max_draft_tokens,
    verify_schedule: flags.VerifySchedule = flags.SPECULATION.verify_schedule,
    cost_curve_file: flags.CostCurveFile = None,
    presence_penalty: flags.PresencePenalty = flags.SAMPLING.presence_penalty,
    frequency_penalty: flags.FrequencyPenalty = flags.SAMPLING.frequency_penalty,
    repetition_penalty: flags.RepetitionPenalty = flags.SAMPLING.repetition_penalty,
    penalty_last_n: flags.PenaltyLastN = flags.SAMPLING.penalty_last_n,
    logit_bias: flags.LogitBias = None,
    json_schema: flags.JsonSchema = None,
    regex: flags.Regex = None,
    grammar: flags.Grammar = None,
    no_mask_draft: flags.NoMaskDraft = False,
    lookup: flags.Lookup = flags.SPECULATION.lookup,
    no_fast_forward: flags.NoFastForward = False,
    tree_nodes: flags.TreeNodes = None,
    chat_template_args: flags.ChatTemplateArgs = None,
    chat_template: Optional[bool] = typer.Option(
        None, "--chat-template/--no-chat-template",
        help="Send the prompt through the tokenizer's chat template (as a user message), or as raw text. "
        "[default: the template when the tokenizer has one; raw text on the demo pair, whose target learned raw Python]",
    ),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Load the target (and the draft) in this dtype: float32, "
                                        "bfloat16 or float16 [default: as stored; float32 for the demo pair]."),
    quantize: flags.Quantize = None,
    draft_quantize: flags.DraftQuantize = None,
    draft_dtype: flags.DraftDtype = None,
    draft_vocab: flags.DraftVocab = None,
    draft_vocab_file: flags.DraftVocabFile = None,
    kv_bits: flags.KvBits = None,
    max_context: flags.MaxContext = None,
    compare: bool = typer.Option(False, "--compare", help="Also run plain decoding on the same prompt: both speeds, and whether the outputs are identical."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the result instead of streaming."),
    pipeline: bool = typer.Option(False, "--pipeline", help=PIPELINE_HELP),
) -> None:
    """Stream a completion to stdout; a summary goes to stderr."""
    from mlx_dspark.api import ResultCollector, stream_generate
    from mlx_dspark.loading.load import load

    if flags.lookup_alone(ctx):
        no_draft, draft = False, flags.LOOKUP_DRAFT
    with flag_errors():
        flags.check_quantize(quantize)
        precision = flags.draft_load_options(ctx.params, speculative=not no_draft)  # --no-draft: the target's only
        tap_ids = flags.parse_tap_ids(draft_tap_ids, draft=draft, model=model)
        # Without --max-tokens, a long prompt shortens the default to the context left (as OpenAI does).
        default_max_tokens = flags.DEFAULT_OPTIONS.max_tokens
        options = flags.generation_options(ctx.params, max_tokens=default_max_tokens if max_tokens is None else max_tokens)
        options = dataclasses.replace(options, clamp_max_tokens=max_tokens is None)
        text = None if prompt is None else read_prompt(prompt)  # before the (slow) load: a bad prompt is told at once
        if system is not None:
            flags.text_flag("--system", system)

    draft = flags.resolve_draft(model, draft, no_draft=no_draft, serve=True, verb="running")  # no --draft: auto, as the server
    on_demo = model is None
    if on_demo:
        try:
            demo = flags.demo_pair()
        except FileNotFoundError as err:
            fail(str(err))
        model, draft, dtype = str(demo.target), draft or str(demo.draft), dtype or demo.dtype
        prompt = demo.prompt if prompt is None else prompt
        form = "through the chat template" if chat_template else "raw text"
        typer.echo(f"[mlx_dspark] {demo.note}; prompt ({form}): {prompt!r}", err=True)
    draft = flags.draft_path(draft)  # `--draft lookup`: the target alone, lookup drafts (options.speculation.lookup)
    speculative = draft is not None and not no_draft
    group = launched_group()  # under `mlx.launch -n N`: the target split over the N ranks as it loads
    with flags.load_errors(model if not speculative else f"{model} + {draft}"):
        pair = load(
            model, draft=draft if speculative else None, dtype=dtype, quantize=quantize,
            draft_tap_ids=tap_ids if speculative else None, split=target_splitter(group, pipeline=pipeline), **precision,
        )  # fmt: skip
    if group is not None:
        split_or_follow(pair, group)

    if needs_cost_curve(options) and pair.draft is not None and not no_draft:
        with flag_errors():  # a draft without a confidence head; the curve is measured here on first use
            options = resolve_cost_curve(pair, options)
        if options.speculation.verify_schedule == "confidence":
            typer.echo(f"[mlx_dspark] verify schedule: confidence, cost curve: {options.speculation.cost_curve.source}", err=True)

    if text is None:  # no --prompt: the demo's own prompt (set above) or the default one
        text = DEFAULT_PROMPT if prompt is None else prompt
    if chat_template and not pair.tokenizer.has_chat_template:
        fail(f"--chat-template: {model} has no chat template; drop the flag to send the prompt as raw text")
    # The demo target learned raw Python, never ChatML: its template (for chat and the server) stays off here.
    raw_text = on_demo or raw_text_prompts(getattr(pair, "target_path", None))  # the demo target, converted or not
    use_template = (not raw_text and pair.tokenizer.has_chat_template) if chat_template is None else chat_template
    if not use_template:
        request = text
    else:
        request = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]

    plain_options = options.replace(speculative=False)
    collector = ResultCollector()
    with flag_errors(), notes_as_lines():  # a prompt or a --max-draft-tokens the loaded pair cannot take
        if compare:  # warm both paths first (kernels, the cost curve): the first run in a process pays for them
            for warm in (options, plain_options):
                for _ in stream_generate(pair, request, options=dataclasses.replace(warm, max_tokens=8)):
                    pass
        for step in stream_generate(pair, request, options=options):
            if not as_json:
                sys.stdout.write(step.text)
                sys.stdout.flush()
            collector.add(step)
    result = collector.result()
    plain = None
    if compare:  # the baseline on the same prompt and options: plain decoding with the target alone
        plain_collector = ResultCollector()
        with flag_errors():
            for step in stream_generate(pair, request, options=plain_options):
                plain_collector.add(step)
        plain = plain_collector.result()
    if as_json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "tokens": result.tokens,
                    "finish_reason": result.finish_reason,
                    "prompt_tokens": result.prompt_tokens,
                    "generation_tokens": len(result.tokens),
                    "prompt_tps": result.prompt_tps,
                    "generation_tps": result.generation_tps,
                    "peak_memory_gb": result.peak_memory_gb,
                    "acceptance_lengths": result.acceptance_lengths,
                    "mean_acceptance_length": round(result.mean_acceptance_length, 3),
                    "draft_lengths": result.draft_lengths,
                    "speculative": (pair.draft is not None or options.speculation.lookup != "off") and not no_draft,
                    "target_forwards": result.target_forwards,
                    **({} if plain is None else {"plain": _comparison(result, plain, greedy=options.sampling.greedy)}),
                }
            )
        )
    else:
        print()
    summary = (
        f"prompt: {result.prompt_tokens} tokens, {result.prompt_tps:.1f} tok/s | "
        f"generation: {len(result.tokens)} tokens, {result.generation_tps:.1f} tok/s | "
        f"{result.target_forwards} target forwards for {len(result.tokens)} tokens"
    )
    if result.acceptance_lengths:
        summary += f" | mean acceptance length {result.mean_acceptance_length:.2f} over {result.rounds} rounds"
        lengths = ", ".join(f"{n}: {count}" for n, count in result.draft_lengths.items())
        summary += f" | draft lengths {{{lengths}}} ({result.draft_lengths.get(0, 0)} rounds parked)"
    summary += f" | peak memory {result.peak_memory_gb:.3f} GB"
    typer.echo(summary, err=True)
    if plain is not None:
        c = _comparison(result, plain, greedy=options.sampling.greedy)
        same = {True: "yes", False: f"no (first difference at token {c['first_difference']})", None: "not expected (sampling)"}[c["identical"]]
        typer.echo(
            f"compare: plain {plain.generation_tps:.1f} tok/s ({plain.target_forwards} target forwards), "
            f"this run {result.generation_tps:.1f} tok/s: {c['speedup']:.2f}x | outputs identical: {same}",
            err=True,
        )


def _comparison(result, plain, *, greedy: bool) -> dict:
    """Speeds of a run and its plain-decoding baseline; identical outputs are expected only when greedy."""
    first = next((i for i, (a, b) in enumerate(zip(result.tokens, plain.tokens)) if a != b), None)
    if first is None and len(result.tokens) != len(plain.tokens):
        first = min(len(result.tokens), len(plain.tokens))
    return {
        "generation_tps": plain.generation_tps,
        "target_forwards": plain.target_forwards,
        "speedup": result.generation_tps / plain.generation_tps if plain.generation_tps else 0.0,
        "identical": (first is None) if greedy else None,
        "first_difference": first,
    }


def main() -> None:
    app()
