"""`python -m mlx_dspark.server`: an OpenAI-compatible HTTP server for a target and its DSpark draft.

Parses flags, binds the socket, loads the pair in the background (requests get 503 until it is
ready) and serves `/v1/chat/completions`, `/v1/completions`, `/v1/models` and `/health`. The pieces
live in `mlx_dspark.serve`; see docs/SERVER.md. With no `--model` it serves the tiny random demo pair.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
from typing import Optional

import typer

app = typer.Typer(add_completion=False, help="Serve a target and its DSpark draft over an OpenAI-compatible API.")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEMO_MODEL_ID = "tiny-spark-demo"


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def check_defaults(
    *, max_tokens: int, temp: float, top_p: float, top_k: int, min_p: float, draft_sampling: str, p_min: float,
    confidence_threshold: float, quantize: Optional[int], max_body_bytes: int,
) -> None:
    """The same checks a request gets, at startup, so a bad flag is one line instead of a 400 per request."""
    from mlx_dspark.api import DRAFT_SAMPLING_MODES
    from mlx_dspark.sample import Sampler

    Sampler(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    if max_tokens < 1:
        raise ValueError(f"--max-tokens-default must be >= 1, got {max_tokens}")
    if draft_sampling not in DRAFT_SAMPLING_MODES:
        raise ValueError(f"--draft-sampling must be one of {DRAFT_SAMPLING_MODES}, got {draft_sampling!r}")
    for name, value in (("--p-min", p_min), ("--confidence-threshold", confidence_threshold)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    if quantize not in (None, 4, 8):
        raise ValueError(f"--quantize must be 4 or 8, got {quantize}")
    if max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {max_body_bytes}")


def parse_template_args(text: Optional[str]) -> Optional[dict]:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--chat-template-args is not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(value, dict):
        raise ValueError("--chat-template-args must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


@app.command()
def serve(
    model: Optional[str] = typer.Option(None, "--model", help="Target: local directory or Hugging Face repo id."),
    draft: Optional[str] = typer.Option(None, "--draft", help="DSpark draft: local directory or repo id."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; 0.0.0.0 exposes the server to the network."),
    port: int = typer.Option(8080, "--port", help="Port to bind (0 picks a free one)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MLX_DSPARK_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1 routes."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="Model id clients use (default: the --model value)."),
    max_tokens_default: int = typer.Option(512, "--max-tokens-default", help="max_tokens when a request gives none."),
    max_body_bytes: int = typer.Option(8 * 1024 * 1024, "--max-body-bytes", help="Larger request bodies get a 413."),
    temp: float = typer.Option(0.0, "--temp", help="Default sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    min_p: float = typer.Option(0.0, "--min-p"),
    draft_sampling: str = typer.Option("greedy", "--draft-sampling", help="greedy or sample."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Plain target decoding (the baseline)."),
    confidence_threshold: float = typer.Option(0.0, "--confidence-threshold"),
    p_min: float = typer.Option(0.0, "--p-min"),
    chat_template_args: Optional[str] = typer.Option(None, "--chat-template-args",
                                                     help="JSON object for the chat template, e.g. '{\"enable_thinking\": false}'."),
    quantize: Optional[int] = typer.Option(None, "--quantize", help="Quantize the target at load time: 4 or 8 bits."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
    allow_origin: list[str] = typer.Option([], "--allow-origin",
                                           help="Let web pages from this origin call the server (repeatable; '*' for any)."),
) -> None:
    """Bind, load the pair in the background, and serve until interrupted."""
    from mlx_dspark.cli import demo_pair
    from mlx_dspark.load import load
    from mlx_dspark.serve.app import make_server
    from mlx_dspark.serve.protocol import Defaults
    if log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        fail(f"--log-level must be debug, info, warning or error, got {log_level!r}")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_defaults(
            max_tokens=max_tokens_default, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
            draft_sampling=draft_sampling, p_min=p_min, confidence_threshold=confidence_threshold,
            quantize=quantize, max_body_bytes=max_body_bytes,
        )
        template_kwargs = parse_template_args(chat_template_args)
    except ValueError as err:
        fail(str(err))

    model_id = served_model_name or model or DEMO_MODEL_ID
    if model is None:
        model, default_draft = (str(p) for p in demo_pair())
        draft = draft or default_draft
    defaults = Defaults(
        max_tokens=max_tokens_default, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p,
        draft_sampling=draft_sampling, p_min=p_min, confidence_threshold=confidence_threshold,
        chat_template_kwargs=template_kwargs,
    )
    loader = functools.partial(load, model, draft=None if no_draft else draft, quantize=quantize)
    try:
        server = make_server(loader, model_id=model_id, host=host, port=port, defaults=defaults, api_key=api_key,
                             max_body_bytes=max_body_bytes, allow_origins=allow_origin)
    except ValueError as err:
        fail(str(err))
    except OSError as err:
        fail(f"cannot listen on {host}:{port}: {err.strerror or err}")
    if host not in LOOPBACK_HOSTS and api_key is None:
        typer.echo(f"[mlx_dspark] warning: listening on {host} without --api-key: anyone who can reach it can use it", err=True)

    typer.echo(f"[mlx_dspark] listening on {server.url}/v1 as model {model_id!r}; loading {model} ...", err=True)
    run_until_interrupted(server)


def run_until_interrupted(server) -> None:
    """Serve with the model's work on this (the main) thread until Ctrl-C or SIGTERM, then exit cleanly.

    The main thread runs MLX: a thread that used MLX must not outlive the interpreter (see
    `ModelWorker._park`), and the main thread is the one that never does. The HTTP side runs in a
    background thread. The first signal stops at once (waiting clients get a 503); while we close,
    further signals are ignored, so shutting down always ends with exit status 0.
    """
    from mlx_dspark.serve.worker import FAILED

    previous_term = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM behaves as Ctrl-C
    try:
        server.start_http()
        server.worker.load()
        if server.worker.state == FAILED:
            server.close(wait_s=0)
            fail(f"could not load the model: {server.worker.load_error}")
        mode = "speculative" if server.worker.speculative else "plain (no draft)"
        typer.echo(f"[mlx_dspark] ready ({mode} decoding) at {server.url}/v1", err=True)
        server.worker.serve_jobs()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        typer.echo("[mlx_dspark] shutting down", err=True)
        server.abort(grace_s=1.0)
    finally:
        if signal.getsignal(signal.SIGTERM) is signal.default_int_handler:
            signal.signal(signal.SIGTERM, previous_term)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
