"""Batch rounds driven as the server's batch worker drives them, for tests and benchmarks."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from mlx_dspark.api import stream_rounds
from mlx_dspark.engine.batch.round import BatchRow, batch_round
from mlx_dspark.engine.round.request import compile_request


def drive_batch(
    model: Any,
    requests: Sequence[tuple[Sequence[int], Any]],
    *,
    joins: Sequence[int],
    draft_cap: Callable[[int], int] | int | None = None,
    cost: Any = None,
    prefill_chunk: int = 8,
    tools: Sequence[Any] | None = None,
    caches: Sequence[Any] | None = None,
) -> tuple[dict[int, list[int]], dict[int, BatchRow], list[int]]:
    """Request i (prompt ids, GenerationOptions) joins at round `joins[i]` and leaves when its stream
    (`api.stream_rounds`: the stop rules of a single request) finishes. Returns each request's tokens,
    its row (`row.forwards`: the rounds that gave it a step; `row.responses`: its StepResponses) and the
    batch's width at every round. `tools[i]` (a chat_format ToolSetup) and `caches[i]` (a PromptCache)
    are request i's, as the server's batch worker passes them."""
    waiting = sorted(range(len(requests)), key=lambda i: joins[i])
    active: dict[int, Any] = {}
    out: dict[int, list[int]] = {}
    rows: dict[int, BatchRow] = {}
    widths: list[int] = []
    round_no = 0
    while waiting or active:
        while waiting and joins[waiting[0]] <= round_no:
            i = waiting.pop(0)
            prompt, options = requests[i]
            cache = None if caches is None else caches[i]
            rows[i] = BatchRow(model, prompt, options, grammar=compile_request(model, options), prompt_cache=cache)
            rows[i].forwards, rows[i].responses = 0, []
            active[i] = stream_rounds(model, prompt, rows[i].steps(), options=options, prompt_cache=cache,
                                      tools=None if tools is None else tools[i])
            out[i] = []
        widths.append(len(active))
        batch_round(model, [rows[i] for i in active], draft_cap=draft_cap, cost=cost, prefill_chunk=prefill_chunk)
        for i, stream in list(active.items()):
            while rows[i].rounds:
                step = next(stream)
                rows[i].forwards += 1
                out[i].extend(step.tokens)
                rows[i].responses.append(step)
                if step.finish_reason is not None:
                    del active[i]
                    break
        round_no += 1
    return out, rows, widths
