"""bench_lookup.py's agent workloads through continuous batching (engine/batch/round.py): target forwards per
100 tokens of a row alone in the batch and of rows sharing it, beside the single request's.

    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/bench_batch_lookup.py \\
        [--model T --draft D] [--workloads rename,diff,tool_call,tool_call_s11,json_record] [--widths 1,3]

Without --model it runs the trained demo pair. Per workload and variant (`dspark`: no lookup, no
fast-forward; `both`: lookup on + fast-forward, the default; `lookup`: lookup alone): `solo` is
`api.generate` (`target_forwards`); `batch xN` runs N copies of the request as rows of `batch_round`
(all joining at round 0, under the fixed cap `row_budget_cap()`); a row's forwards are the
rounds it got a Round from (its prompt's last chunk, then every verify), the count `target_forwards`
makes for a single request. Greedy: every row must write the solo tokens (checked). `rounds` is the
batch's own count of packed forwards (prompt chunks of 128 tokens included) per 100 tokens of all rows.
Counts, not times: exact on a loaded machine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_dspark.api import encode_prompt, generate, stream_rounds  # noqa: E402
from mlx_dspark.chat_format.turn import ToolSetup  # noqa: E402
from mlx_dspark.engine.batch.round import BatchRow, batch_round  # noqa: E402
from mlx_dspark.engine.batch.length import row_budget_cap  # noqa: E402
from mlx_dspark.engine.context_length import context_length, fit_max_tokens  # noqa: E402
from mlx_dspark.engine.options import GenerationOptions, SpeculationOptions  # noqa: E402
from mlx_dspark.engine.round.request import compile_request  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_lookup", Path(__file__).with_name("bench_lookup.py"))
bench_lookup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_lookup)

VARIANTS = {"dspark": dict(lookup="off", fast_forward=False), "both": dict(lookup="on"), "lookup": dict(lookup="only")}


def row_request(pair, request: dict, max_tokens: int, variant: dict) -> tuple[list[int], GenerationOptions]:
    """The prompt ids and options `generate(pair, **request, **variant)` would run."""
    setup = ToolSetup.of(request.get("tools"), request.get("tool_choice"), parallel=request.get("parallel_tool_calls", True))
    constraint = setup.constraint(pair.tokenizer) or request.get("constraint")
    prompt_ids = encode_prompt(pair.tokenizer, request["prompt"], tools=setup.offered)
    options = GenerationOptions(max_tokens=max_tokens, constraint=constraint, speculation=SpeculationOptions(**variant))
    fitted = fit_max_tokens(len(prompt_ids), options, *context_length(pair, options))
    return prompt_ids, dataclasses.replace(options, max_tokens=fitted)


def run_batch(pair, prompt_ids: list[int], options: GenerationOptions, width: int) -> tuple[list[list[int]], list[int], int]:
    """`width` copies of one request as batch rows: each row's tokens and forwards, and the batch's rounds."""
    rows = [BatchRow(pair, prompt_ids, options, grammar=compile_request(pair, options)) for _ in range(width)]
    streams = [stream_rounds(pair, prompt_ids, r.steps(), options=options) for r in rows]
    tokens, forwards, active, rounds = [[] for _ in rows], [0] * width, set(range(width)), 0
    while active:
        batch_round(pair, [rows[i] for i in sorted(active)], draft_cap=row_budget_cap())
        rounds += 1
        for i in sorted(active):
            while rows[i].rounds:
                step = next(streams[i])
                forwards[i] += 1
                tokens[i].extend(step.tokens)
                if step.finish_reason is not None:
                    active.discard(i)
                    break
    return tokens, forwards, rounds


def main() -> None:
    parser = bench_lookup.workload_parser(__doc__.splitlines()[0], VARIANTS)
    parser.add_argument("--widths", default="1,3")
    args = parser.parse_args()
    pair = bench_lookup.load_pair(args)
    specs = json.loads((bench_lookup.WORKLOADS / "workloads.json").read_text())
    widths = [int(w) for w in args.widths.split(",")]
    print("| workload (tokens, prompt) | variant | solo fwd/100 | " + " | ".join(f"batch x{w} fwd/100 (rounds/100)" for w in widths) + " |")
    print("|---|---|---|" + "---|" * len(widths))
    for name in args.workloads.split(","):
        request = bench_lookup.workload_requests(name, specs[name], pair.tokenizer)
        max_tokens = args.max_tokens or specs[name]["max_tokens"]
        for variant in args.variants.split(","):
            solo = generate(pair, max_tokens=max_tokens, **request, **VARIANTS[variant])
            prompt_ids, options = row_request(pair, request, max_tokens, VARIANTS[variant])
            cells = []
            for width in widths:
                tokens, forwards, rounds = run_batch(pair, prompt_ids, options, width)
                assert all(t == solo.tokens for t in tokens), f"{name} {variant} x{width}: a row differs from its solo run"
                per_row = sorted(100 * f / len(t) for f, t in zip(forwards, tokens))
                cells.append(f"{'/'.join(f'{x:.1f}' for x in sorted(set(per_row)))} ({100 * rounds / sum(map(len, tokens)):.1f})")
            label = f"{name} ({len(solo.tokens)}, {solo.prompt_tokens})"
            print(f"| {label} | {variant} | {100 * solo.target_forwards / len(solo.tokens):.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
