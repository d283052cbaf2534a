"""A batch's chained drafts: each row's k chain steps alone vs one packed drafter forward per step.

    python scripts/bench_batch_chains.py /tmp/bench/scaled/target --draft /tmp/bench/scaled/eagle3
    python scripts/bench_batch_chains.py /tmp/bench/scaled/mtp-target --draft mtp
    python scripts/bench_batch_chains.py /tmp/lmpair/target --draft /tmp/lmpair/draft  # a draft model (the lm head)

n rows (n = 2, 4, 8), each with its own prompt (lengths 40 + 23 i: their drafter caches differ) prefilled
through the target and its chained head's proposer, propose k drafts (greedy):
- per row: each row's own `propose` (its k steps, as before; what a single request runs);
- packed: `engine/batch/chains.propose_chains` over the n rows (one drafter forward and one head call per step).
Both go back to the committed entries, so every repeat sees the same caches (a draft model reads its prompt
at its first proposal: the best of the repeats leaves that out). The two are interleaved per
repeat and the fastest of --repeats is printed, with the drafts of both compared (they must be equal).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_dspark  # noqa: E402
from mlx_dspark.engine.batch.chains import chains_packable, propose_chains  # noqa: E402
from mlx_dspark.engine.proposers import default_head  # noqa: E402
from mlx_dspark.engine.options import GenerationOptions  # noqa: E402
from mlx_dspark.engine.round.request import head_proposer  # noqa: E402


def make_rows(pair, n: int) -> list[SimpleNamespace]:
    vocab, rows = pair.target.args.vocab_size, []
    for i in range(n):
        committed = [(7 + 13 * i + 31 * j) % vocab for j in range(40 + 23 * i)]
        proposer = head_proposer(pair, default_head(pair), committed[:-1], GenerationOptions())
        _, features = pair.target(mx.array([committed[:-1]]), cache=pair.target.make_cache(), tap_ids=proposer.tap_ids)
        proposer.extend(features)
        proposer.commit([committed[-1]])
        proposer.flush()
        rows.append(SimpleNamespace(proposer=proposer, position=len(committed) - 1, anchor=committed[-1]))
    return rows


def per_row(rows, k: int) -> list[list[int]]:
    made = [r.proposer.propose(mx.array([r.anchor]), position=r.position, num_tokens=k).tokens for r in rows]
    mx.eval(made)
    return [t[0].tolist() for t in made]


def packed(rows, k: int) -> list[list[int]]:
    made = [p.tokens for p in propose_chains(rows, [k] * len(rows), [None] * len(rows))]
    mx.eval(made)
    return [t[0].tolist() for t in made]


def main(target: str, draft: str = typer.Option(..., help="a chained head: 'mtp', an EAGLE-3 draft's or a draft model's path"),
         steps: str = "1,3,4", widths: str = "2,4,8", repeats: int = 7) -> None:
    pair = mlx_dspark.load(target, draft=draft)
    for n in (int(w) for w in widths.split(",")):
        rows = make_rows(pair, n)
        assert chains_packable(rows), "the drafter's packed step fails its probe"
        for k in (int(s) for s in steps.split(",")):
            best = {"per row": float("inf"), "packed": float("inf")}
            drafts = {}
            for _ in range(repeats):
                for name, run in (("per row", per_row), ("packed", packed)):
                    start = time.perf_counter()
                    drafts[name] = run(rows, k)
                    best[name] = min(best[name], time.perf_counter() - start)
            same = drafts["per row"] == drafts["packed"]
            print(f"n={n} k={k}: per row {best['per row'] * 1e3:7.2f} ms  packed {best['packed'] * 1e3:7.2f} ms  "
                  f"ratio {best['per row'] / best['packed']:.2f}x  drafts equal: {same}", flush=True)


if __name__ == "__main__":
    typer.run(main)
