"""Continuous batching with speculation vs today's one-at-a-time queue, on the scaled pair.

    python scripts/make_scaled_spark_pair.py /tmp/scaled
    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/bench_batch.py /tmp/scaled \\
        --out benchmarks/results/batch.json

C clients (1, 2, 4, 8) send a request each at t = 0 (distinct prompts of --prompt-tokens, --max-tokens
each, greedy). Five ways to serve them, interleaved per repeat (rotated), medians over repeats:
- queue plain / queue spec: today's worker, one `generate` after another (speculative: a controlled
  acceptance, as bench/controlled.py: the real draft runs every round, its proposal is replaced by the
  target's own continuation with one error per round so acceptance lengths average --acceptance);
- batch plain / batch spec (auto, planned) / batch spec (auto, per row) / batch spec (fixed 7):
  `engine/batch.batch_round` over all C rows (newcomers' prompts prefilled in the rounds); "planned" is
  what the server runs: this machine's packed-forward costs (`batch_length.measure_batch_cost`) and one
  plan of every row's length per round; "per row": each row's own `auto` policy over the single-request
  curve, blind to the batch; "fixed 7": the whole block every round.
The queue's speculative variant runs `auto` over the single-request curve (`measure_cost_curve`), as a
single request does by default.
Per variant: aggregate tok/s (all generated tokens / time to the last finish), per-request tok/s (its
tokens / its time from t = 0 to its finish, queueing included), and whether each output equals the
target's plain greedy continuation. The cost curve (packed forward of n rows, packed draft of w rows)
is printed beside. Engine measurement on random weights: acceptance is controlled, never the model's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_dspark.bench.controlled import AcceptanceSchedule, greedy_reference, reference_block  # noqa: E402
from mlx_dspark.bench.stats import loadavg, median  # noqa: E402
from mlx_dspark.engine.round.decode import plain_steps, speculative_steps  # noqa: E402
from mlx_dspark.engine.logits.sample import Sampler  # noqa: E402
from mlx_dspark.engine.batch.round import BatchRow, batch_round  # noqa: E402
from mlx_dspark.engine.batch.length import measure_batch_cost  # noqa: E402
from mlx_dspark.engine.costs.probe import measure_cost_curve  # noqa: E402
from mlx_dspark.engine.options import GenerationOptions, SpeculationOptions  # noqa: E402
from mlx_dspark.engine.prompt_cache import PromptCache  # noqa: E402
from mlx_dspark.engine.proposers.base import Proposal
from mlx_dspark.engine.proposers.dspark import DraftProposer  # noqa: E402
from mlx_dspark.loading.load import load  # noqa: E402


class ControlledRowProposer(DraftProposer):
    """The real draft forward (solo or packed), its proposal replaced by the reference with one error per round."""

    def __init__(self, model, *, context, reference, prompt_len, acceptance):
        super().__init__(model.draft, model.target, greedy=True, temperature=1.0, context=context)
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, model.target.args.vocab_size
        self.schedule = AcceptanceSchedule(acceptance, block_size=self.block_size)

    def propose(self, anchor, *, position, num_tokens, logits_hook=None):
        return self.revise(super().propose(anchor, position=position, num_tokens=num_tokens), position=position, num_tokens=num_tokens)

    def revise(self, proposal, *, position, num_tokens):
        length = self.schedule.next()
        return Proposal(tokens=reference_block(proposal, self.reference, start=position - self.prompt_len + 1, num_tokens=num_tokens,
                                               wrong=length - 1 if length <= num_tokens else None, vocab_size=self.vocab))  # fmt: skip


def serve_queue(model, prompts, references, *, max_tokens, speculative, tau, curve):
    """Today's worker: one request after another (its step generator, read to max_tokens as the batch's rows are)."""
    start, finishes, outputs, drafts = time.perf_counter(), [], [], []
    for ids, ref in zip(prompts, references):
        if speculative:
            proposer = ControlledRowProposer(model, context=None, reference=ref, prompt_len=len(ids), acceptance=tau)
            speculation = SpeculationOptions(max_draft_tokens="auto", cost_curve=curve)
            steps = speculative_steps(model.target, proposer, ids, sampler=Sampler(), max_tokens=max_tokens, speculation=speculation)
        else:
            steps = plain_steps(model.target, ids, sampler=Sampler())
        tokens = []
        for step in steps:
            tokens.extend(step.tokens)
            drafts.append(getattr(step, "proposed", 0))
            if len(tokens) >= max_tokens:
                break
        steps.close()
        finishes.append(time.perf_counter() - start)
        outputs.append(tokens[:max_tokens])
    return finishes, outputs, drafts


def serve_batch(model, prompts, references, *, max_tokens, speculative, tau, length, curve, cost, chunk):
    start = time.perf_counter()
    rows, finishes, drafts = [], {}, []
    for ids, ref in zip(prompts, references):
        # lookup off: the rows' acceptance is the controlled one (the queue's speculative_steps has none)
        speculation = SpeculationOptions(speculative=speculative, max_draft_tokens=length, cost_curve=curve, lookup="off")
        options = GenerationOptions(max_tokens=max_tokens, speculation=speculation)
        cache = PromptCache(model.target, model.draft, max_snapshots=0)
        proposer = (ControlledRowProposer(model, context=cache.draft_context, reference=ref, prompt_len=len(ids), acceptance=tau)
                    if speculative else None)  # fmt: skip
        rows.append(BatchRow(model, ids, options, prompt_cache=cache, proposer=proposer))
    tokens = {id(r): [] for r in rows}
    active = list(rows)
    while active:
        batch_round(model, active, cost=cost, prefill_chunk=chunk)
        for row in list(active):
            while row.rounds:
                done = row.rounds.popleft()
                tokens[id(row)].extend(done.tokens)
                drafts.append(done.proposed)
            if len(tokens[id(row)]) >= max_tokens:
                finishes[id(row)] = time.perf_counter() - start
                active.remove(row)
    return [finishes[id(r)] for r in rows], [tokens[id(r)][:max_tokens] for r in rows], drafts


def _rounded(table: dict) -> dict:
    return {k: round(v, 1) for k, v in table.items()}


def main(
    pair: Path = typer.Argument(..., help="directory with target/ and draft/ (scripts/make_scaled_spark_pair.py)"),
    clients: str = typer.Option("1,2,4,8", "--clients"),
    max_tokens: int = typer.Option(32, "--max-tokens"),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens"),
    acceptance: float = typer.Option(4.0, "--acceptance", help="controlled mean acceptance length"),
    repeats: int = typer.Option(2, "--repeats"),
    chunk: int = typer.Option(128, "--prefill-chunk"),
    out: Path = typer.Option(None, "--out"),
) -> None:
    model = load(pair / "target", draft=pair / "draft")
    counts = [int(c) for c in clients.split(",")]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 300, size=prompt_tokens).tolist() for _ in range(max(8, *counts))]
    block = int(model.draft.num_drafts)
    references = [greedy_reference(model.target, ids, max_tokens + block + 2) for ids in prompts[: max(counts)]]
    curve = measure_cost_curve(model.target, model.draft, context=prompt_tokens, deep_context=None)
    cost = measure_batch_cost(model.target, model.draft, max_batch=max(counts), context=prompt_tokens)
    print(f"single-request curve (ms): draft block {curve.draft_ms:.1f}, verify 1..{block + 1}: {[round(v, 1) for v in curve.verify_ms]}")
    print(f"packed costs (ms): one sequence of n rows {_rounded(cost.rows_ms)}; w sequences of one row {_rounded(cost.sequences_ms)}; "
          f"draft block of w sequences {_rounded(cost.draft_ms)}")
    queue = lambda speculative: lambda p, r: serve_queue(model, p, r, max_tokens=max_tokens, speculative=speculative, tau=acceptance, curve=curve)  # noqa: E731
    batch = lambda speculative, length, planned: lambda p, r: serve_batch(  # noqa: E731
        model, p, r, max_tokens=max_tokens, speculative=speculative, tau=acceptance, length=length, curve=curve,
        cost=cost if planned else None, chunk=chunk)  # fmt: skip
    variants = {
        "queue plain": queue(False),
        "queue spec (auto)": queue(True),
        "batch plain": batch(False, None, False),
        "batch spec (auto, planned)": batch(True, "auto", True),
        "batch spec (auto, per row)": batch(True, "auto", False),
        "batch spec (fixed 7)": batch(True, None, False),
    }
    batch(True, "auto", True)(prompts[:2], references[:2])  # warm-up
    load_before = loadavg()
    samples = {(c, name): {"aggregate": [], "per_request": [], "match": [], "drafts": []} for c in counts for name in variants}
    for repeat in range(repeats):
        for c in counts:
            names = list(variants)
            names = names[repeat % len(names):] + names[: repeat % len(names)]
            for name in names:
                finishes, outputs, drafts = variants[name](prompts[:c], references[:c])
                s = samples[(c, name)]
                s["aggregate"].append(c * max_tokens / max(finishes))
                s["per_request"].append(median([max_tokens / f for f in finishes]))
                s["drafts"].extend(drafts)
                s["match"].extend(o == ref[: len(o)] for o, ref in zip(outputs, references[:c]))
    rows = []
    for c in counts:
        base = median(samples[(c, "queue plain")]["aggregate"])
        for name in variants:
            s = samples[(c, name)]
            row = {"clients": c, "variant": name, "aggregate_tps": median(s["aggregate"]),
                   "per_request_tps": median(s["per_request"]), "aggregate_vs_queue_plain": median(s["aggregate"]) / base,
                   "outputs_match_reference": sum(s["match"]) / len(s["match"]), "aggregate_runs": s["aggregate"],
                   "mean_drafts_per_round": sum(s["drafts"]) / max(len(s["drafts"]), 1)}  # fmt: skip
            rows.append(row)
            print(f"C={c} {name:28s} aggregate {row['aggregate_tps']:6.1f} tok/s ({row['aggregate_vs_queue_plain']:.2f}x queue plain)"
                  f"  per-request {row['per_request_tps']:6.1f} tok/s  drafts/round {row['mean_drafts_per_round']:.1f}"
                  f"  match {row['outputs_match_reference']:.2f}")
    report = {"label": "engine measurement (controlled acceptance), not model acceptance", "max_tokens": max_tokens,
              "prompt_tokens": prompt_tokens, "acceptance_length": acceptance, "repeats": repeats,
              "single_request_curve": curve.to_json(), "packed_costs": cost.to_json(), "rows": rows,
              "loadavg_before": load_before, "loadavg_after": loadavg()}  # fmt: skip
    print(f"loadavg {load_before} -> {report['loadavg_after']}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    typer.run(main)
