"""A batch of draft-model rows (the `lm` head) decoding: their chain steps packed vs each row's own k steps.

    python scripts/make_lm_draft_pair.py /tmp/lmpair --epsilon 0.02458
    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/bench_batch_draft_lm.py /tmp/lmpair/target \\
        --draft /tmp/lmpair/draft --rows 4 --max-tokens 64 --draft-tokens 4 --repeats 5

R rows (distinct prompts of 40 + 23 i tokens), greedy, a fixed draft length, all joining at round 0, run by
`batch_round` as the server's batch worker runs them. Their prompts are prefilled first (untimed); then the
decode is timed until every row has --max-tokens (no stop rules: the random pair's text means nothing).
Two ways, interleaved per repeat (rotated):
- packed: what a batch does (engine/batch/chains.py: each row catches up alone on the tokens its draft has
  not read, then ONE packed forward of the draft per chain step for all rows still drafting);
- per row: the same rows with their proposers' declared `packs_chains` off (each row drafts its k steps
  alone, engine/batch/propose.py's per-row path, as before).
Printed per way: median and best decode time, tokens per second, rounds, and whether the tokens equal
(greedy: they must). The draft's own saving per round is `bench_batch_chains.py --draft PATH`.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_dspark  # noqa: E402
from mlx_dspark.bench.stats import loadavg  # noqa: E402
from mlx_dspark.engine.batch.round import BatchRow, batch_round  # noqa: E402
from mlx_dspark.engine.options import GenerationOptions, SpeculationOptions  # noqa: E402


def run(pair, prompts: list[list[int]], options: GenerationOptions, *, packed: bool) -> tuple[float, int, list[list[int]]]:
    """One batched run: (decode seconds, rounds, each row's tokens)."""
    rows = [BatchRow(pair, prompt, options) for prompt in prompts]
    if not packed:
        for row in rows:
            row.proposer.packs_chains = False  # the declared ability off: the batch drafts this row by itself
    tokens: list[list[int]] = [[] for _ in rows]

    def advance(active: list[int]) -> None:
        batch_round(pair, [rows[i] for i in active])
        for i in active:
            while rows[i].rounds:
                tokens[i].extend(rows[i].rounds.popleft().tokens)

    while any(row.prefilling for row in rows):
        advance(list(range(len(rows))))
    rounds, start = 0, time.perf_counter()
    while active := [i for i, row in enumerate(rows) if row.emitted < options.max_tokens]:
        advance(active)
        rounds += 1
    return time.perf_counter() - start, rounds, [t[: options.max_tokens] for t in tokens]


def main(target: str, draft: str = typer.Option(..., help="a draft model's directory (a causal LM of the target's vocabulary)"),
         rows: int = 4, max_tokens: int = 64, draft_tokens: int = 4, repeats: int = 5) -> None:  # fmt: skip
    pair = mlx_dspark.load(target, draft=draft)
    assert list(pair.heads) == ["lm"], f"a draft model's pair, not {list(pair.heads)}"
    problem = pair.heads["lm"].packing_problem()
    assert problem is None, problem
    vocab = pair.target.args.vocab_size
    prompts = [[(7 + 13 * i + 31 * j) % vocab for j in range(40 + 23 * i)] for i in range(rows)]
    options = GenerationOptions(max_tokens=max_tokens, speculation=SpeculationOptions(max_draft_tokens=draft_tokens))
    ways = ["packed", "per row"]
    run(pair, prompts, options, packed=True)  # warm-up
    times: dict[str, list[float]] = {w: [] for w in ways}
    made: dict[str, tuple[int, list[list[int]]]] = {}
    for r in range(repeats):
        for way in ways[r % 2 :] + ways[: r % 2]:
            seconds, count, tokens = run(pair, prompts, options, packed=way == "packed")
            times[way].append(seconds)
            made[way] = (count, tokens)
    print(f"{rows} rows, {max_tokens} tokens each, {draft_tokens} drafts per round, {repeats} repeats; loadavg {loadavg()}")
    for way in ways:
        med, best = statistics.median(times[way]), min(times[way])
        print(f"{way:8s}: decode median {med * 1e3:8.1f} ms  best {best * 1e3:8.1f} ms  "
              f"{rows * max_tokens / med:6.1f} tok/s  rounds {made[way][0]}", flush=True)
    ratio = statistics.median(times["per row"]) / statistics.median(times["packed"])
    print(f"per row / packed (medians): {ratio:.2f}x; tokens equal: {made['packed'][1] == made['per row'][1]}")


if __name__ == "__main__":
    typer.run(main)
