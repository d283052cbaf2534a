"""`python -m mlx_dspark.chat`: a chat in the terminal that keeps the conversation's caches between turns.

Reads one user message per line from stdin, renders the whole conversation with the chat template,
streams the reply to stdout and prints a short statistics line to stderr. The conversation's
`PromptCache` lives across turns, so each turn prefills only what the previous one did not hold
(`cached` in the statistics). `/reset` starts a new conversation (and a new cache); `/exit` or
end of input quits. The generation flags are those of `mlx_dspark.generate`; with no `--model` it
chats with the trained demo pair (a small code model: its replies are code-like text).
The reply is read as the template's reasoning, content and tool calls (`--tools FILE`: a JSON list
of OpenAI function tools): thinking is printed between `[thinking]` and `[/thinking]`, each call on
its own `[tool call] name {arguments}` line, the content as it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import typer

from mlx_dspark.cli import common as flags
from mlx_dspark.engine.proposers.lookup import LOOKUP_MAX_TOKENS
from mlx_dspark.api import GenerationResult, ResultCollector, StepResponse, encode_prompt, make_prompt_cache, stream_generate
from mlx_dspark.chat_format.turn import OutputCollector, ToolSetup
from mlx_dspark.cli.common import fail, flag_errors
from mlx_dspark.engine.options import GenerationOptions

app = typer.Typer(add_completion=False, help="Chat with a target and its DSpark draft, keeping the conversation warm.")

RESET, EXIT = "/reset", "/exit"


class ChatSession:
    """One conversation: its messages and the prompt cache that holds them."""

    def __init__(self, model: Any, *, options: GenerationOptions, system: str | None = None,
                 tools: list[dict] | None = None) -> None:
        self.model = model
        self.options = options
        self.system = system
        self.tools = ToolSetup.of(tools)
        self.reader: OutputCollector | None = None  # the reply being read (reasoning, content, calls)
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        # lookup blocks are longer than a draft block: caches that roll a whole one back
        rollback = None if self.options.speculation.lookup == "off" else LOOKUP_MAX_TOKENS
        self.prompt_cache = make_prompt_cache(self.model, max_rollback=rollback)
        self.last: GenerationResult | None = None

    def say(self, text: str) -> Iterator[StepResponse]:
        """Stream the reply to `text`; the reply joins the conversation when the stream ends or is closed.

        A reply cut short (Ctrl-C, a closed generator) stays in the conversation as far as it got,
        which is exactly what the prompt cache holds.
        """
        messages = self.messages + [{"role": "user", "content": text}]
        self.last = None
        collector = ResultCollector()
        prompt = encode_prompt(self.model.tokenizer, messages, chat_template_kwargs=self.options.chat_template_kwargs,
                               tools=self.tools.offered)
        self.reader = OutputCollector(self.tools.parser(self.model.tokenizer, prompt))
        steps = stream_generate(self.model, messages, options=self.options, prompt_cache=self.prompt_cache,
                                tools=self.tools.offered)
        try:
            for step in steps:
                collector.add(step)
                yield step
        finally:
            steps.close()
            if collector.last is not None:
                self.messages = messages + [{"role": "assistant", "content": "".join(collector.text)}]
                if collector.last.finish_reason is not None:
                    self.last = collector.result()


class ReplyPrinter:
    """Reasoning, content and tool calls of a streamed reply, each shown its own way."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.thinking = False
        self.streaming: str | None = None  # id of the call being printed

    def show(self, events: list[tuple[str, Any]]) -> None:
        for kind, value in events:
            if kind == "reasoning" and not self.thinking:
                self.out.write("[thinking] ")
                self.thinking = True
            elif kind != "reasoning" and self.thinking:
                self.out.write(" [/thinking]\n")
                self.thinking = False
            if kind == "tool_call_begin":  # a call whose arguments stream
                self.out.write(f"\n[tool call] {value.name} ")
                self.streaming = value.id
            elif kind == "tool_call_delta":
                self.out.write(value)
            elif kind == "tool_call":
                self.out.write("\n" if self.streaming == value.id else f"\n[tool call] {value.name} {value.arguments}\n")
                self.streaming = None
            else:
                self.out.write(value)
        self.out.flush()

    def end(self) -> None:
        if self.thinking:
            self.out.write(" [/thinking]")
        self.out.write("\n")
        self.out.flush()


def read_tools(path: str) -> list[dict]:
    """`--tools FILE`: a JSON list of OpenAI function tools (checked by the chat session)."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"--tools: cannot read {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--tools: {path} is not JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(value, list):
        raise ValueError(f"--tools: {path} must hold a JSON list of function tools")
    return value


def stats_line(result: GenerationResult) -> str:
    line = (
        f"[prompt {result.prompt_tokens} tokens, {result.cached_tokens} cached, {result.prompt_tps:.1f} tok/s | "
        f"reply {len(result.tokens)} tokens, {result.generation_tps:.1f} tok/s"
    )
    if result.acceptance_lengths:
        line += f" | mean acceptance length {result.mean_acceptance_length:.2f}"
        line += f" | draft lengths {result.draft_lengths}, {result.draft_lengths.get(0, 0)} rounds parked"
    return line + "]"


@app.command()
def chat(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", help="Target: local directory or Hugging Face repo id."),
    draft: Optional[str] = typer.Option(None, "--draft", "--draft-model", help="DSpark draft: local directory or repo id."),
    system: Optional[str] = typer.Option(None, "--system", help="System message for the chat template."),
    tools_file: Optional[str] = typer.Option(None, "--tools", help="JSON file: a list of OpenAI function tools the template offers."),
    max_tokens: int = typer.Option(flags.DEFAULT_OPTIONS.max_tokens, "--max-tokens", "-m", help="Most tokens per reply."),
    temp: flags.Temp = flags.SAMPLING.temperature,
    top_p: flags.TopP = flags.SAMPLING.top_p,
    top_k: flags.TopK = flags.SAMPLING.top_k,
    min_p: flags.MinP = flags.SAMPLING.min_p,
    seed: flags.Seed = flags.SAMPLING.seed,
    draft_sampling: flags.DraftSampling = flags.SPECULATION.draft_sampling,
    no_draft: flags.NoDraft = False,
    lookup: flags.Lookup = flags.SPECULATION.lookup,
    no_fast_forward: flags.NoFastForward = False,
    confidence_threshold: flags.ConfidenceThreshold = flags.SPECULATION.confidence_threshold,
    p_min: flags.PMin = flags.SPECULATION.p_min,
    max_draft_tokens: flags.MaxDraftTokens = flags.SPECULATION.max_draft_tokens,
    chat_template_args: flags.ChatTemplateArgs = None,
    quantize: flags.Quantize = None,
) -> None:
    """One user message per line; replies on stdout, statistics on stderr.

    Every turn goes through the tokenizer's chat template (the demo pair's included); for raw text use
    `python -m mlx_dspark.generate --no-chat-template`."""
    from mlx_dspark.loading.load import load

    if flags.lookup_alone(ctx):
        no_draft, draft = False, flags.LOOKUP_DRAFT
    with flag_errors():
        flags.check_quantize(quantize)
        options = flags.generation_options(ctx.params, max_tokens=max_tokens)  # the shared flags, read by name
        tools = read_tools(tools_file) if tools_file is not None else None

    draft = flags.resolve_draft(model, draft, no_draft=no_draft, serve=True, verb="running")  # no --draft: auto, as the server
    dtype = None
    if model is None:
        try:
            demo = flags.demo_pair()
        except FileNotFoundError as err:
            fail(str(err))
        model, draft, dtype = str(demo.target), draft or str(demo.draft), demo.dtype
        typer.echo(f"[mlx_dspark] {demo.note}", err=True)
    draft = flags.draft_path(draft)  # `--draft lookup`: the target alone, lookup drafts
    with flags.load_errors(model if no_draft or draft is None else f"{model} + {draft}"):
        pair = load(model, draft=None if no_draft else draft, quantize=quantize, dtype=dtype)
    if not pair.tokenizer.has_chat_template:
        fail(f"{model} has no chat template; use `python -m mlx_dspark.generate --no-chat-template` for raw text")

    with flag_errors():
        if flags.needs_cost_curve(options) and pair.draft is not None:  # the curve read (or measured) once, not per turn
            options = flags.resolve_cost_curve(pair, options)
        session = ChatSession(pair, options=options, system=system, tools=tools)
    interactive = sys.stdin.isatty()
    typer.echo(f"[mlx_dspark] chatting with {model}: {RESET} starts over, {EXIT} or end of input quits", err=True)
    while True:
        if interactive:
            sys.stdout.write(">> ")
            sys.stdout.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            break
        if not line:
            break  # end of input
        text = line.rstrip("\r\n")
        if text.strip() == EXIT:
            break
        if text.strip() == RESET:
            session.reset()
            typer.echo("[mlx_dspark] new conversation", err=True)
            continue
        if not text.strip():
            continue
        reply = session.say(text)
        printer = ReplyPrinter(sys.stdout)
        with flag_errors():  # a prompt or a --max-draft-tokens the loaded pair cannot take
            try:
                for step in reply:
                    printer.show(session.reader.add(step.text, final=step.finish_reason is not None))
            except KeyboardInterrupt:
                typer.echo("\n[mlx_dspark] reply interrupted", err=True)
            finally:
                reply.close()
        printer.end()
        if session.last is not None:
            typer.echo(stats_line(session.last), err=True)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
