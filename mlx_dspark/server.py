"""`python -m mlx_dspark.server`: an OpenAI-compatible HTTP server for a target and its DSpark draft.

Parses flags, binds the socket, loads the pair in the background (requests get 503 until it is
ready) and serves `/v1/chat/completions`, `/v1/completions`, `/v1/models` and `/health`. The pieces
live in `mlx_dspark.serve`; see docs/SERVER.md. With no `--model` it serves the tiny random demo pair.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import typer

from mlx_dspark import cli_common as flags
from mlx_dspark.cli_common import fail, flag_errors
from mlx_dspark.serve.cache_pool import PromptCacheBudget, parse_bytes
from mlx_dspark.serve.protocol import SERVER_DEFAULTS

app = typer.Typer(add_completion=False, help="Serve a target and its DSpark draft over an OpenAI-compatible API.")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEMO_MODEL_ID = "tiny-spark-demo"


@app.command()
def serve(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", help="Target: local directory or Hugging Face repo id."),
    draft: Optional[str] = typer.Option(None, "--draft", help="DSpark draft: local directory or repo id."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; 0.0.0.0 exposes the server to the network."),
    port: int = typer.Option(8080, "--port", help="Port to bind (0 picks a free one)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MLX_DSPARK_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1 routes."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="Model id clients use (default: the --model value)."),
    max_tokens_default: int = typer.Option(SERVER_DEFAULTS.max_tokens, "--max-tokens-default", help="max_tokens when a request gives none."),
    max_body_bytes: int = typer.Option(8 * 1024 * 1024, "--max-body-bytes", help="Larger request bodies get a 413."),
    prompt_cache_size: int = typer.Option(
        PromptCacheBudget.conversations, "--prompt-cache-size",
        help="Conversations whose caches are kept for reuse by later requests (0 = off).",
    ),
    prompt_cache_bytes: str = typer.Option(
        f"{PromptCacheBudget.nbytes // 10**9}GB", "--prompt-cache-bytes", help="Memory budget of the kept caches, e.g. 2GB, 512MB (least recently used go first).",
    ),
    temp: flags.Temp = flags.SAMPLING.temperature,
    top_p: flags.TopP = flags.SAMPLING.top_p,
    top_k: flags.TopK = flags.SAMPLING.top_k,
    min_p: flags.MinP = flags.SAMPLING.min_p,
    draft_sampling: flags.DraftSampling = flags.SPECULATION.draft_sampling,
    no_draft: flags.NoDraft = False,
    confidence_threshold: flags.ConfidenceThreshold = flags.SPECULATION.confidence_threshold,
    p_min: flags.PMin = flags.SPECULATION.p_min,
    max_draft_tokens: flags.MaxDraftTokens = flags.SPECULATION.max_draft_tokens,
    chat_template_args: flags.ChatTemplateArgs = None,
    quantize: flags.Quantize = None,
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Bind, load the pair in the background, and serve until interrupted."""
    from mlx_dspark.load import load
    from mlx_dspark.serve.app import make_server
    from mlx_dspark.serve.worker import FAILED

    if log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        fail(f"--log-level must be debug, info, warning or error, got {log_level!r}")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The same checks a request gets, at startup, so a bad flag is one line instead of a 400 per request.
    with flag_errors({**flags.FLAGS, "max_tokens": "--max-tokens-default"}):
        flags.check_quantize(quantize)
        if max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {max_body_bytes}")
        defaults = flags.generation_options(ctx.params, max_tokens=max_tokens_default)  # the shared flags, by name
        prompt_cache = _prompt_cache_budget(prompt_cache_size, prompt_cache_bytes)

    model_id = served_model_name or model or DEMO_MODEL_ID
    if model is None:
        model, default_draft = (str(p) for p in flags.demo_pair())
        draft = draft or default_draft
    loader = functools.partial(load, model, draft=None if no_draft else draft, quantize=quantize)
    try:
        server = make_server(loader, model_id=model_id, host=host, port=port, defaults=defaults, api_key=api_key,
                             max_body_bytes=max_body_bytes, prompt_cache=prompt_cache)
    except OSError as err:
        fail(f"cannot listen on {host}:{port}: {err.strerror or err}")
    if host not in LOOPBACK_HOSTS and api_key is None:
        typer.echo(f"[mlx_dspark] warning: listening on {host} without --api-key: anyone who can reach it can use it", err=True)

    typer.echo(f"[mlx_dspark] listening on {server.url}/v1 as model {model_id!r}; loading {model} ...", err=True)
    server.start()
    try:
        server.worker.loaded.wait()
        if server.worker.state == FAILED:
            server.close(wait_s=0)
            fail(f"could not load the model: {server.worker.load_error}")
        if server.worker.speculative:
            try:
                defaults.speculation.draft_length(server.worker.model.draft.args.block_size)
            except ValueError as err:
                server.close(wait_s=0)
                fail(f"--max-draft-tokens: {err}")
        mode = "speculative" if server.worker.speculative else "plain (no draft)"
        typer.echo(f"[mlx_dspark] ready ({mode} decoding) at {server.url}/v1", err=True)
        server.wait()
    except KeyboardInterrupt:
        typer.echo("[mlx_dspark] shutting down", err=True)
    server.close(wait_s=0)


def _prompt_cache_budget(size: int, nbytes: str) -> PromptCacheBudget:
    if size < 0:
        raise ValueError(f"--prompt-cache-size must be >= 0 (0 turns reuse off), got {size}")
    try:
        return PromptCacheBudget(conversations=size, nbytes=parse_bytes(nbytes))
    except ValueError as err:
        raise ValueError(f"--prompt-cache-bytes: {err}") from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
