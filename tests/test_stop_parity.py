"""Speculation stops on exactly plain decoding's last token, for every way a generation ends (issue 39).

A verify round commits a block at once; plain decoding would have stopped at the block's first token
that ends the output. On the trained demo pair (greedy, so speculative output is plain output), every
stop kind (end-of-sequence, a stop token id, a stop string, max_tokens, a forced / named / unforced
single tool call, a grammar that reaches its end) gives the same tokens, text, finish reason and tool
calls as plain decoding, with a block draft, lookup alone, the defaults (auto, lookup beside the
draft, a grammar's forced runs verified in the block) and as a batched row beside another request;
the caller's prompt cache then holds no token past the output. Where the stop can be put inside a
round of the speculative run (picked from that run), the test also checks that the round was cut.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import pytest

import mlx_dspark
from mlx_dspark.api import GenerationCancelled, encode_prompt, make_prompt_cache, stream_generate
from mlx_dspark.chat_format.turn import ToolSetup
from mlx_dspark.cli.demo import demo_pair
from mlx_dspark.engine.logits.constraints import Constraint
from mlx_dspark.engine.proposers.lookup import LOOKUP_MAX_TOKENS
from mlx_dspark.engine.options import GenerationOptions, SpeculationOptions
from tests.batch_helpers import drive_batch

PROMPT = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau alpha beta gamma"
COMPANION = "import os\nimport sys\nimport json\nimport"  # the other row of a batched run
MAX_TOKENS = 48
WORD = {"type": "function", "function": {"name": "lookup_word", "description": "Look up a word", "parameters": {
    "type": "object", "properties": {"word": {"enum": ["zorbleflax", "quib"]}, "lang": {"enum": ["Klingon", "Elvish"]}},
    "required": ["word", "lang"], "additionalProperties": False}}}  # fmt: skip
MESSAGES = [{"role": "user", "content": "Please look up the word zorbleflax in Klingon."}]
# the model writes a call unforced (tool_choice auto) under a regex, and goes on writing after it
UNFORCED = Constraint.regex(r'<tool_call>\n\{"name": "lookup_word", "arguments": \{"word": "quib", "lang": "Elvish"\}\}\n'
                            r"</tool_call>[a-z ]{4,30}")
SCHEMA = Constraint.json_schema({"type": "object", "properties": {"word": {"enum": ["zorbleflax", "quib"]}},
                                 "required": ["word"], "additionalProperties": False})
PLAIN = SpeculationOptions(speculative=False)
SETTINGS = {
    "draft": SpeculationOptions(max_draft_tokens=7, lookup="off"),  # the DSpark block draft alone
    "lookup": SpeculationOptions(lookup="only"),
    "default": SpeculationOptions(),  # auto, lookup beside the draft, forced runs verified (fast_forward)
    "batch": SpeculationOptions(),  # the defaults, as a row of a batch beside another request
}


@pytest.fixture(scope="module")
def demo():
    pair = demo_pair()
    return mlx_dspark.load(str(pair.target), draft=str(pair.draft))


@dataclass
class Run:
    tokens: list[int]
    text: str
    finish_reason: str
    calls: list[tuple[str, str]]
    steps: list  # StepResponses
    held: tuple[int, ...]  # what the prompt cache holds afterwards
    output: list[int]  # prompt + emitted tokens

    @property
    def cut(self) -> bool:
        """The last round committed more tokens than the output kept (the cut this module tests)."""
        last = self.steps[-1]
        return last.verified and len(last.tokens) < last.accepted + 1


def generate_run(model, prompt, options: GenerationOptions, setup: ToolSetup, *, batch: bool) -> Run:
    cache = make_prompt_cache(model, max_rollback=LOOKUP_MAX_TOKENS)
    prompt_ids = encode_prompt(model.tokenizer, prompt, tools=setup.offered)
    if batch:  # as the server's batch worker: the request's options carry the forced call's constraint
        forced = setup.constraint(model.tokenizer)
        if forced is not None:
            options = dataclasses.replace(options, constraint=forced)
        companion = (encode_prompt(model.tokenizer, COMPANION), GenerationOptions(max_tokens=24))
        _, rows, widths = drive_batch(model, [(prompt_ids, options), companion], joins=[0, 0],
                                      tools=[setup, None], caches=[cache, None])
        assert max(widths) == 2
        steps = rows[0].responses
    else:
        steps = list(stream_generate(model, prompt_ids, options=options, prompt_cache=cache, tools=list(setup.tools),
                                     tool_choice=setup.choice, parallel_tool_calls=setup.parallel))
    tokens = [t for s in steps for t in s.tokens]
    reader = setup.parser(model.tokenizer, prompt_ids)  # the server reads the calls off the step texts so
    events = [e for s in steps for e in reader.feed(s.text)] + reader.finish()
    calls = [(c.name, c.arguments) for kind, c in events if kind == "tool_call"]
    return Run(tokens, "".join(s.text for s in steps), steps[-1].finish_reason, calls, steps, cache.tokens,
               prompt_ids + tokens)


def check_same(spec: Run, plain: Run) -> None:
    assert spec.tokens == plain.tokens
    assert (spec.text, spec.finish_reason, spec.calls) == (plain.text, plain.finish_reason, plain.calls)
    for run in (spec, plain):  # the prompt cache: nothing past the output, all of it but the last token
        assert run.held == tuple(run.output[: len(run.held)])
        assert len(run.output) - 1 <= len(run.held) <= len(run.output)


def options_for(speculation: SpeculationOptions, **fields) -> GenerationOptions:
    return GenerationOptions(max_tokens=fields.pop("max_tokens", MAX_TOKENS), speculation=speculation, **fields)


# -- stops picked inside a round of the speculative run ----------------------------------------------


def _round_positions(run: Run) -> list[int]:
    """Indices of output tokens that are not the last of their round (a stop there cuts the round)."""
    inside, start = [], 0
    for step in run.steps:
        inside += range(start, start + len(step.tokens) - 1)
        start += len(step.tokens)
    return inside


def _first_new_token(run: Run) -> tuple[int, bool]:
    """A token whose first occurrence is inside a round when there is one (else any first occurrence)."""
    firsts = [i for i in range(2, len(run.tokens)) if run.tokens[i] not in run.tokens[:i]]
    inside = [i for i in firsts if i in set(_round_positions(run))]
    return (inside or firsts)[0], bool(inside)


def _stop_string(model, run: Run) -> str | None:
    """The shortest text that first appears when a token inside a round is added."""
    decode = model.tokenizer.decode
    for i in _round_positions(run):
        before, after = decode(run.tokens[:i]), decode(run.tokens[: i + 1])
        if len(after) <= len(before) or not after.startswith(before):
            continue
        end = len(before) + 1
        for start in range(end - 1, -1, -1):
            if after.find(after[start:end]) == start:
                return after[start:end]
    return None


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", ["eos", "stop_token_ids", "stop_string", "max_tokens"])
def test_a_text_generation_stops_on_plain_decoding_s_last_token(demo, kind, setting):
    batch, speculation = setting == "batch", SETTINGS[setting]
    free = generate_run(demo, PROMPT, options_for(speculation), ToolSetup(), batch=batch)
    model, fields, inside = demo, {}, False
    if kind in ("eos", "stop_token_ids"):
        index, inside = _first_new_token(free)
        if kind == "eos":  # a pair of its own whose tokenizer ends on that token
            pair = demo_pair()
            model = mlx_dspark.load(str(pair.target), draft=str(pair.draft))
            model.tokenizer.add_eos_token(free.tokens[index])
        else:
            fields["stop_token_ids"] = (free.tokens[index],)
    elif kind == "stop_string":
        stop = _stop_string(demo, free)
        assert stop is not None, "no round of the speculative run committed two tokens or more"
        fields["stop"], inside = (stop,), True
    else:
        index = _round_positions(free)[0] if _round_positions(free) else len(free.tokens) // 2
        fields["max_tokens"] = index + 1
    plain = generate_run(model, PROMPT, options_for(PLAIN, **fields), ToolSetup(), batch=False)
    spec = generate_run(model, PROMPT, options_for(speculation, **fields), ToolSetup(), batch=batch)
    check_same(spec, plain)
    assert plain.finish_reason == ("length" if kind == "max_tokens" else "stop")
    if inside:
        assert spec.cut, "the stop was inside a round of the speculative run: that round is cut"


# -- tool calls and grammars ---------------------------------------------------------------------------

CHAT_KINDS = {
    "forced": (MESSAGES, ToolSetup.of([WORD], "required", parallel=False), {}),
    "named": (MESSAGES, ToolSetup.of([WORD], {"type": "function", "function": {"name": "lookup_word"}}), {}),
    "unforced": (MESSAGES, ToolSetup.of([WORD], "auto", parallel=False), {"constraint": UNFORCED}),
    "grammar_end": (PROMPT, ToolSetup(), {"constraint": SCHEMA}),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", list(CHAT_KINDS))
def test_a_tool_call_or_a_grammar_ends_on_plain_decoding_s_last_token(demo, kind, setting):
    prompt, setup, fields = CHAT_KINDS[kind]
    plain = generate_run(demo, prompt, options_for(PLAIN, max_tokens=160, **fields), setup, batch=False)
    spec = generate_run(demo, prompt, options_for(SETTINGS[setting], max_tokens=160, **fields), setup,
                        batch=setting == "batch")
    check_same(spec, plain)
    assert plain.finish_reason == "stop"
    if kind == "grammar_end":
        assert plain.tokens[-1] in demo.tokenizer.eos_token_ids  # the grammar's end forces end-of-sequence
    else:
        assert len(plain.calls) == 1 and plain.text.rstrip().endswith("</tool_call>")  # nothing after the call
        assert not plain.calls[0][1].startswith((" ", "\n"))  # the arguments string, however it was chunked
    if kind in ("forced", "unforced") and setting != "batch":
        assert spec.cut  # the demo pair's round that completes the call commits more (its end, text after)


# -- cancellation --------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", ["plain", "draft", "lookup", "default"])
def test_a_cancelled_generation_is_plain_output_so_far_and_leaves_the_cache_reusable(demo, setting):
    """Cancelled after 12 tokens were seen: what came is a prefix of plain output (whole rounds), the
    prompt cache holds no token past it, and the next generation on the cache is plain output again."""
    speculation = PLAIN if setting == "plain" else SETTINGS[setting]
    plain = generate_run(demo, PROMPT, options_for(PLAIN), ToolSetup(), batch=False)
    cache, cancel, tokens = make_prompt_cache(demo, max_rollback=LOOKUP_MAX_TOKENS), threading.Event(), []
    prompt_ids = encode_prompt(demo.tokenizer, PROMPT)
    with pytest.raises(GenerationCancelled):
        for step in stream_generate(demo, prompt_ids, options=options_for(speculation), prompt_cache=cache, cancel=cancel):
            tokens += step.tokens
            if len(tokens) >= 12:
                cancel.set()
    assert 12 <= len(tokens) < MAX_TOKENS and tokens == plain.tokens[: len(tokens)]
    held, output = cache.tokens, prompt_ids + tokens
    assert held == tuple(output[: len(held)]) and len(held) >= len(output) - 1
    again = list(stream_generate(demo, prompt_ids, options=options_for(speculation), prompt_cache=cache))
    assert again[0].cached_tokens > 0 and [t for s in again for t in s.tokens] == plain.tokens


# -- through the server --------------------------------------------------------------------------------


def _streamed_call(events: list) -> tuple[str, str, int]:
    """A streamed chat completion's one call (name, arguments joined from its deltas) and its usage."""
    name, arguments, usage = None, "", None
    for event in events:
        if event == "[DONE]":
            break
        if event.get("usage"):
            usage = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            for call in choice["delta"].get("tool_calls") or []:
                name = call["function"].get("name") or name
                arguments += call["function"].get("arguments") or ""
    return name, arguments, usage


def test_the_server_s_completion_tokens_for_a_forced_call_are_plain_decoding_s_in_every_setting():
    """The forced call (parallel_tool_calls false) through /v1/chat/completions, whole and streamed, one
    request at a time and batched: usage.completion_tokens and the call's arguments string are plain
    decoding's for the defaults, a fixed block of 7 and lookup alone."""
    from tests.test_server import call, pair_loader, running_server, stream

    pair = demo_pair()
    body = {"messages": MESSAGES, "tools": [WORD], "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 0, "max_tokens": 160}
    servers = {"plain": ({"defaults": GenerationOptions(max_tokens=512, speculation=PLAIN)}, {}),
               "default": ({}, {}), "fixed 7": ({}, {"max_draft_tokens": 7}),
               "lookup only": ({"defaults": GenerationOptions(max_tokens=512, speculation=SpeculationOptions(lookup="only"))}, {}),
               "batched": ({"max_batch": 2}, {})}  # fmt: skip
    seen = {}
    for name, (server_options, fields) in servers.items():
        with running_server(pair_loader((pair.target, pair.draft)), **server_options) as srv:
            status, _, reply = call(srv, "POST", "/v1/chat/completions", {**body, **fields})
            assert status == 200, reply
            (tool_call,) = reply["choices"][0]["message"]["tool_calls"]
            events = stream(srv, "/v1/chat/completions", {**body, **fields, "stream_options": {"include_usage": True}})
            seen[name] = (reply["usage"]["completion_tokens"], tool_call["function"]["name"],
                          tool_call["function"]["arguments"], reply["choices"][0]["finish_reason"])
            assert _streamed_call(events) == (seen[name][1], seen[name][2], seen[name][0])
    assert len(set(seen.values())) == 1, seen
    assert seen["plain"][3] == "tool_calls" and not seen["plain"][2].startswith(" ")
