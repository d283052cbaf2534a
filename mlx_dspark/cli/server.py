"""`python -m mlx_dspark.server`: an OpenAI-compatible HTTP server for a target and its DSpark draft.

Parses flags, binds the socket, loads the pair in the background (requests get 503 until it is
ready) and serves `/v1/chat/completions`, `/v1/completions`, `/v1/models` and `/health`. The pieces
live in `mlx_dspark.serve`; see docs/SERVER.md. With no `--model` it serves the trained demo pair
shipped in the package (a Python-code model without a chat template: use /v1/completions).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import signal
from typing import Optional

import typer

from mlx_dspark.cli import common as flags
from mlx_dspark.cli.common import exit_on_interrupt, fail, flag_errors
from mlx_dspark.cli.split import PIPELINE_HELP, launched_group, split_or_follow, target_splitter
from mlx_dspark.engine.options import GenerationOptions
from mlx_dspark.serve.cache_pool import PromptCacheBudget, parse_bytes
from mlx_dspark.serve.protocol import DEFAULT_MAX_BATCH, SERVER_DEFAULTS

app = typer.Typer(add_completion=False, help="Serve a target and its DSpark draft over an OpenAI-compatible API.")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEMO_MODEL_ID = "mlx-dspark-demo"


@app.command()
@exit_on_interrupt()  # Ctrl-C before serving starts; once it runs, run_until_interrupted exits 0
def serve(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", help=flags.MODEL_HELP),
    draft: Optional[str] = typer.Option(None, "--draft", "--draft-model", help=flags.DRAFT_HELP),
    draft_tap_ids: flags.DraftTapIds = None,
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
    lookup: flags.Lookup = flags.SPECULATION.lookup,
    no_fast_forward: flags.NoFastForward = False,
    confidence_threshold: flags.ConfidenceThreshold = flags.SPECULATION.confidence_threshold,
    p_min: flags.PMin = flags.SPECULATION.p_min,
    max_draft_tokens: flags.MaxDraftTokens = flags.SPECULATION.max_draft_tokens,
    verify_schedule: flags.VerifySchedule = flags.SPECULATION.verify_schedule,
    tree_nodes: flags.TreeNodes = None,
    cost_curve_file: flags.CostCurveFile = None,
    chat_template_args: flags.ChatTemplateArgs = None,
    quantize: flags.Quantize = None,
    draft_quantize: flags.DraftQuantize = None,
    draft_dtype: flags.DraftDtype = None,
    draft_vocab: flags.DraftVocab = None,
    draft_vocab_file: flags.DraftVocabFile = None,
    kv_bits: flags.KvBits = None,
    max_context: flags.MaxContext = None,
    tool_parser: Optional[str] = typer.Option(
        None, "--tool-parser", help="mlx-lm tool parser for the model's tool calls (e.g. json_tools, qwen3_coder); "
        "default: the one mlx-lm infers from the chat template."),
    max_batch: Optional[int] = typer.Option(
        None, "--max-batch", help=f"Requests served at once (continuous batching, draft lengths planned per round for the "
        f"whole batch); 1 = one at a time. Default: {DEFAULT_MAX_BATCH}, or one at a time for a pair that cannot be batched."),
    batch_max_tokens: Optional[int] = typer.Option(
        None, "--batch-max-tokens", help="The most context tokens (prompt + max_tokens) the requests served at once hold "
        "together, for their caches' memory; a request past it waits its turn. Default: what 3/4 of this machine's "
        "memory leaves beside the weights and the prompt cache."),
    batch_prefill_chunk: int = typer.Option(
        128, "--batch-prefill-chunk", help="With --max-batch > 1: prompt tokens a newcomer prefills per round (smaller keeps running streams smoother)."),
    force_tool_call: Optional[str] = typer.Option(
        None, "--force-tool-call", help="Trial aid for models too weak to call tools: the first model turn of a "
        "conversation that offers this tool and leaves tool_choice to the model gets it as its forced, named choice."),
    stop: list[str] = typer.Option([], "--stop", help="A stop sequence for requests that give none of their own "
                                   "(repeatable; e.g. for a model that never ends its replies)."),
    keepalive_s: float = typer.Option(10.0, "--keepalive-s", help="Seconds between keep-alives on a stream waiting "
                                      "for its first token (Anthropic ping events, SSE comments)."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
    metrics: bool = typer.Option(True, "--metrics/--no-metrics",
                                 help="Serve Prometheus metrics at GET /metrics (behind --api-key when one is set)."),
    allow_origin: list[str] = typer.Option([], "--allow-origin",
                                           help="Let web pages from this origin call the server (repeatable; '*' for any)."),
    allow_template_kwarg: list[str] = typer.Option(
        [], "--allow-template-kwarg",
        help="Let clients set this chat template switch in chat_template_kwargs (repeatable; "
        "enable_thinking, thinking_effort and reasoning_effort are always allowed).",
    ),  # fmt: skip
    pipeline: bool = typer.Option(False, "--pipeline", help=PIPELINE_HELP),
) -> None:
    """Bind, load the pair in the background, and serve until interrupted.

    Chat completions, Messages and Responses go through the tokenizer's chat template; /v1/completions
    takes its prompt as raw text. Under `mlx.launch -n N` the target is split over the N ranks: every rank
    loads it first, rank 0 then binds and serves one request at a time, the others follow its forwards."""
    from mlx_dspark.loading.load import load
    from mlx_dspark.serve.app import make_server
    if log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        fail(f"--log-level must be debug, info, warning or error, got {log_level!r}")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if flags.lookup_alone(ctx):
        no_draft, draft = False, flags.LOOKUP_DRAFT
    # The same checks a request gets, at startup, so a bad flag is one line instead of a 400 per request.
    with flag_errors({**flags.FLAGS, "max_tokens": "--max-tokens-default"}):
        flags.check_quantize(quantize)
        precision = flags.draft_load_options(ctx.params, speculative=not no_draft)
        tap_ids = flags.parse_tap_ids(draft_tap_ids, draft=draft, model=model)
        if max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {max_body_bytes}")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
        if batch_max_tokens is not None and batch_max_tokens < 1:
            raise ValueError(f"--batch-max-tokens must be >= 1, got {batch_max_tokens}")
        if batch_prefill_chunk < 1:
            raise ValueError(f"--batch-prefill-chunk must be >= 1, got {batch_prefill_chunk}")
        defaults = flags.generation_options(ctx.params, max_tokens=max_tokens_default)  # the shared flags, by name
        if stop:
            defaults = dataclasses.replace(defaults, stop=list(stop))
        prompt_cache = _prompt_cache_budget(prompt_cache_size, prompt_cache_bytes)
        if tool_parser is not None:
            from mlx_dspark.loading.tokenizer import check_tool_parser

            try:
                check_tool_parser(tool_parser)
            except ValueError as err:
                raise ValueError(f"--tool-parser: {err}") from None

    max_batch = _tree_batch(max_batch, defaults.speculation.tree_nodes)
    model_id = served_model_name or model or DEMO_MODEL_ID
    draft = flags.resolve_draft(model, draft, no_draft=no_draft, serve=True)
    dtype = None
    if model is None:
        try:
            demo = flags.demo_pair()
        except FileNotFoundError as err:
            fail(str(err))
        typer.echo(f"[mlx_dspark] {demo.note}; its small chat template renders tools (its replies stay code-like)", err=True)
        model, draft, dtype = str(demo.target), draft or str(demo.draft), demo.dtype
    draft = flags.draft_path(draft)  # `--draft lookup`: the target alone, lookup drafts
    speculative = draft is not None and not no_draft
    loader = functools.partial(
        load, model, draft=draft if speculative else None, dtype=dtype, quantize=quantize,
        draft_tap_ids=tap_ids if speculative else None, tool_parser=tool_parser, **precision,
    )  # fmt: skip
    group = launched_group()  # under `mlx.launch -n N`: the target split over the ranks, rank 0 serves
    split = group is not None
    if split:
        max_batch, prompt_cache = _one_at_a_time(max_batch, ranks=group.size(), rank=group.rank())
        with flags.load_errors(model if not speculative else f"{model} + {draft}"):
            pair = loader(split=target_splitter(group, pipeline=pipeline, serving=True))  # each rank reads its slice
        split_or_follow(pair, group)  # ranks > 0 follow rank 0's requests here, then exit
        loader = functools.partial(_loaded, pair)
    try:
        server = make_server(loader, model_id=model_id, host=host, port=port, defaults=defaults, api_key=api_key,
                             max_body_bytes=max_body_bytes, allow_origins=allow_origin,
                             prompt_cache=prompt_cache, max_batch=max_batch or DEFAULT_MAX_BATCH, batch_required=max_batch is not None, batch_max_tokens=batch_max_tokens,
                             batch_prefill_chunk=batch_prefill_chunk,
                             allow_template_kwargs=allow_template_kwarg, keepalive_s=keepalive_s,
                             force_tool_call=force_tool_call, metrics=metrics)
    except ValueError as err:
        fail(str(err))
    except OSError as err:
        fail(f"cannot listen on {host}:{port}: {err.strerror or err}")
    if host not in LOOPBACK_HOSTS and api_key is None:
        typer.echo(f"[mlx_dspark] warning: listening on {host} without --api-key: anyone who can reach it can use it", err=True)

    loading = "" if split else f"; loading {model} ..."  # a split target is loaded (and split) before the bind
    typer.echo(f"[mlx_dspark] listening on {server.url}/v1 as model {model_id!r}{loading}", err=True)
    run_until_interrupted(server, defaults, between_forwards=split)


def _tree_batch(max_batch: Optional[int], tree_nodes: int | str) -> Optional[int]:
    """--tree-nodes: one request at a time unless --max-batch asks more (a batched row runs chain rounds)."""
    if not tree_nodes:
        return max_batch
    if max_batch is None:
        typer.echo(f"[mlx_dspark] --tree-nodes {tree_nodes}: one request at a time (tree rounds verify one request; "
                   "give --max-batch N to batch requests in chain rounds instead)", err=True)
        return 1
    if max_batch > 1:
        typer.echo(f"[mlx_dspark] --tree-nodes {tree_nodes} with --max-batch {max_batch}: batched requests run chain "
                   "rounds (tree rounds verify one request at a time)", err=True)
    return max_batch


def _one_at_a_time(max_batch: Optional[int], *, ranks: int, rank: int) -> tuple[int, PromptCacheBudget]:
    """A split target's server settings: one request at a time, no prompt cache reuse (the followers hold
    no copy of rank 0's kept caches: every request prefills its whole prompt on every rank)."""
    if max_batch is not None and max_batch > 1:
        fail(f"--max-batch {max_batch}: a target split over {ranks} ranks serves one request at a time (batching "
             "across ranks is not built); drop --max-batch or give 1")
    if rank == 0:
        typer.echo(f"[mlx_dspark] a target split over {ranks} ranks: one request at a time (--max-batch 1), "
                   "prompt cache reuse off (every request prefills its whole prompt)", err=True)
    return 1, PromptCacheBudget(conversations=0)


def _loaded(pair):
    return pair


def run_until_interrupted(server, defaults: GenerationOptions, *, between_forwards: bool = False) -> None:
    """Serve with the model's work on this (the main) thread until Ctrl-C or SIGTERM, then exit cleanly.

    The main thread runs MLX: a thread that used MLX must not outlive the interpreter (see
    `ModelWorker._park`), and the main thread is the one that never does. The HTTP side runs in a
    background thread. The first signal stops at once (waiting clients get a 503); while we close,
    further signals are ignored, so shutting down always ends with exit status 0.

    `between_forwards` (a split target's rank 0): the signal only sets `worker.interrupted` and the worker
    stops at its next step or idle poll, never inside a target forward it has announced to the followers
    (they would wait in that forward's collectives); a prefill under way ends first.
    """
    from mlx_dspark.serve.worker import FAILED

    def interrupt(signum, frame):  # SIGTERM behaves as Ctrl-C
        server.worker.interrupted.set()  # seen by the serving loop even if the KeyboardInterrupt is swallowed
        if not between_forwards:
            raise KeyboardInterrupt

    previous_int = signal.signal(signal.SIGINT, interrupt)
    previous_term = signal.signal(signal.SIGTERM, interrupt)
    try:
        server.start_http()
        server.worker.load()
        if server.worker.state == FAILED:
            server.close(wait_s=0)
            fail(f"could not load the model: {server.worker.load_error}")
        if server.worker.speculative:
            try:
                defaults.speculation.draft_length(server.worker.model.draft.num_drafts)
            except ValueError as err:
                server.close(wait_s=0)
                fail(f"--max-draft-tokens: {err}")
            if flags.needs_cost_curve(defaults) or defaults.speculation.verify_schedule == "confidence":
                try:  # checked, and the curve measured or read from the cache, now rather than in the first request
                    flags.resolve_cost_curve(server.worker.model, defaults)
                except ValueError as err:
                    server.close(wait_s=0)
                    fail(f"--verify-schedule: {err}")
        mode = "speculative" if server.worker.speculative else "plain (no draft)"
        typer.echo(f"[mlx_dspark] ready ({mode} decoding) at {server.url}/v1", err=True)
        server.worker.serve_jobs()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        typer.echo("[mlx_dspark] shutting down", err=True)
        server.abort(grace_s=1.0)
    finally:
        if signal.getsignal(signal.SIGTERM) is interrupt:
            signal.signal(signal.SIGTERM, previous_term)
        if signal.getsignal(signal.SIGINT) is interrupt:
            signal.signal(signal.SIGINT, previous_int)


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
