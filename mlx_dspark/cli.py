"""The generate command line: parses flags, loads the pair, streams text to stdout.

With no `--model`, it runs a tiny random spark2_5 pair generated on first use (a demo of the whole
path, not of output quality). Errors a user can fix are one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, help="Generate text with a target and its DSpark draft.")

DEMO_DIR = Path.home() / ".cache" / "mlx_dspark" / "tiny-spark-pair"


def demo_pair() -> tuple[Path, Path]:
    """The tiny random spark2_5 pair used when no model is given, written once."""
    from mlx_dspark.testing.tiny import write_tiny_pair

    target, draft = DEMO_DIR / "target", DEMO_DIR / "draft"
    if not (target / "config.json").exists() or not (draft / "config.json").exists():
        typer.echo(f"[mlx_dspark] no --model given: writing a tiny random spark2_5 pair to {DEMO_DIR}", err=True)
        write_tiny_pair(DEMO_DIR, family="spark2_5", seed=0)
    return target, draft


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def read_prompt(prompt: str) -> str:
    return sys.stdin.read() if prompt == "-" else prompt


@app.command()
def generate(
    model: Optional[str] = typer.Option(None, "--model", help="Target: local directory or Hugging Face repo id."),
    draft: Optional[str] = typer.Option(None, "--draft", help="DSpark draft: local directory or repo id."),
    prompt: str = typer.Option("Write a short poem about the sea.", "--prompt", "-p", help="Prompt text, or - for stdin."),
    system: Optional[str] = typer.Option(None, "--system", help="System message for the chat template."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m"),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    min_p: float = typer.Option(0.0, "--min-p"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    draft_sampling: str = typer.Option("greedy", "--draft-sampling", help="greedy or sample."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Plain target decoding (the baseline)."),
    confidence_threshold: float = typer.Option(0.0, "--confidence-threshold"),
    p_min: float = typer.Option(0.0, "--p-min"),
    chat_template_args: Optional[str] = typer.Option(None, "--chat-template-args", help="JSON object for the chat template."),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Use the prompt as raw text."),
    quantize: Optional[int] = typer.Option(None, "--quantize", help="Quantize the target at load time: 4 or 8 bits."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the result instead of streaming."),
) -> None:
    """Stream a completion to stdout; a summary goes to stderr."""
    from mlx_dspark.api import ResultCollector, stream_generate
    from mlx_dspark.load import load

    template_kwargs = None
    if chat_template_args:
        try:
            template_kwargs = json.loads(chat_template_args)
        except json.JSONDecodeError as err:
            fail(f"--chat-template-args is not valid JSON ({err.msg} at column {err.colno})")
        if not isinstance(template_kwargs, dict):
            fail("--chat-template-args must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    if quantize not in (None, 4, 8):
        fail(f"--quantize must be 4 or 8, got {quantize}")
    if draft_sampling not in ("greedy", "sample"):
        fail(f"--draft-sampling must be 'greedy' or 'sample', got {draft_sampling!r}")

    if model is None:
        model, default_draft = (str(p) for p in demo_pair())
        draft = draft or default_draft
    try:
        pair = load(model, draft=None if no_draft else draft, quantize=quantize)
    except (ValueError, FileNotFoundError, OSError) as err:
        fail(str(err))

    text = read_prompt(prompt)
    if no_chat_template or not pair.tokenizer.has_chat_template:
        request = text
    else:
        request = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]

    options = dict(
        max_tokens=max_tokens,
        temperature=temp,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        draft_sampling=draft_sampling,
        speculative=not no_draft,
        confidence_threshold=confidence_threshold,
        p_min=p_min,
        chat_template_kwargs=template_kwargs,
    )
    collector = ResultCollector()
    try:
        for step in stream_generate(pair, request, **options):
            if not as_json:
                sys.stdout.write(step.text)
                sys.stdout.flush()
            collector.add(step)
    except ValueError as err:
        fail(str(err))
    result = collector.result()
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
                    "mean_acceptance_length": result.mean_acceptance_length,
                    "speculative": pair.draft is not None and not no_draft,
                }
            )
        )
    else:
        print()
    summary = (
        f"prompt: {result.prompt_tokens} tokens, {result.prompt_tps:.1f} tok/s | "
        f"generation: {len(result.tokens)} tokens, {result.generation_tps:.1f} tok/s"
    )
    if result.acceptance_lengths:
        summary += f" | mean acceptance length {result.mean_acceptance_length:.2f} over {result.rounds} rounds"
    summary += f" | peak memory {result.peak_memory_gb:.3f} GB"
    typer.echo(summary, err=True)


def main() -> None:
    app()
