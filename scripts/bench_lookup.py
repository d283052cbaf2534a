"""Agent workloads (benchmarks/workloads/): plain vs DSpark vs lookup vs both, with and without fast-forward.

    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/bench_lookup.py [--model T --draft D]
        [--workloads rename,diff,tool_call,tool_call_s11,json_record] [--repeats 3] [--max-tokens N]

Without --model it runs the trained demo pair. Per workload the variants run interleaved, `--repeats`
times; greedy, so every variant must write the same tokens (checked). Reported: target forwards per 100
generated tokens (the prefill's last forward included, as `GenerationResult.target_forwards` counts),
decode tok/s (median), mean tokens per verify round. `dspark` is the round before issue 27 (no lookup,
no fast-forward); `dspark+ff` adds the grammar's forced runs; `both-unmasked` / `both-automask` draft unmasked / choose per
request (mask_choice.py) (these three on constrained workloads only). The cost
curve (verify forwards of 1..33 tokens and a draft block, ms) is printed first.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlx_dspark.api import generate
from mlx_dspark.chat_format.turn import ToolSetup
from mlx_dspark.cli.common import demo_pair
from mlx_dspark.engine.logits.constraints import Constraint, ToolCallShape
from mlx_dspark.engine.round.decode import prefill
from mlx_dspark.engine.proposers.dspark import DraftProposer
from mlx_dspark.loading.load import load
from mlx_dspark.models.caches.kv import trim_caches

WORKLOADS = Path(__file__).resolve().parents[1] / "benchmarks" / "workloads"
VARIANTS = {
    "plain": dict(speculative=False),
    "dspark": dict(fast_forward=False),
    "dspark+ff": dict(),
    "lookup": dict(lookup="only"),
    "both": dict(lookup="on"),
    # constrained workloads only: the draft unmasked, and the per-request choice between the two
    "both-unmasked": dict(lookup="on", mask_draft=False),
    "both-automask": dict(lookup="on", mask_draft="auto"),
}
CONSTRAINED_ONLY = ("dspark+ff", "both-unmasked", "both-automask")


def workload_requests(name: str, spec: dict, tokenizer) -> dict | None:
    """The generate() keywords of one workload (a raw-text forced call where the tokenizer has no chat template)."""
    source = (WORKLOADS / "inventory.py").read_text()
    fill = {"{file}": source, "{diff}": (WORKLOADS / "patch.diff").read_text(), "{file_head}": "\n".join(source.splitlines()[:40])}

    def filled(text: str) -> str:
        for key, value in fill.items():
            text = text.replace(key, value)
        return text

    if "messages" in spec:
        messages = [{**m, "content": filled(m["content"])} for m in spec["messages"]]
        try:  # a chat template whose calls are JSON (the demo pair's)
            ToolSetup.of([spec["tool"]], "required", parallel=False).constraint(tokenizer)
            return dict(prompt=messages, tools=[spec["tool"]], tool_choice="required", parallel_tool_calls=False)
        except ValueError:
            pass
        # none (the scaled pair's tiny tokenizer): the same forced call (Qwen3's syntax) over the raw user text
        function = spec["tool"]["function"]
        schema = {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": function["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False}
        shape = ToolCallShape("<tool_call>\n", schema, "\n</tool_call>")
        return dict(prompt=messages[-1]["content"], constraint=Constraint.tool_calls([shape], parallel=False))
    kwargs = dict(prompt=filled(spec["prompt"]))
    if "schema" in spec:
        kwargs["constraint"] = Constraint.json_schema(spec["schema"])
    return kwargs


def cost_curve(pair, widths=(1, 2, 4, 8, 16, 24, 33), context=512, repeats=3) -> dict:
    """Median ms of verify forwards of each width and of a draft block, at `context` positions."""
    target, draft = pair.target, pair.draft
    proposer = DraftProposer(draft, target, greedy=True, temperature=1.0) if draft is not None else None
    cache = target.make_cache(max_rollback=max(widths))
    rng = random.Random(0)
    vocab = target.args.vocab_size
    tap_ids = proposer.tap_ids if proposer else ()
    logits = prefill(target, cache, [rng.randrange(vocab) for _ in range(context)], tap_ids=tap_ids, proposer=proposer)
    anchor = mx.argmax(logits).astype(mx.int32).reshape(1)
    candidates = mx.array([[rng.randrange(vocab) for _ in range(max(widths))]], dtype=mx.int32)
    samples: dict = {w: [] for w in (["draft"] if proposer else []) + list(widths)}
    for repeat in range(repeats + 1):
        for width in samples:
            start = time.perf_counter()
            if width == "draft":
                mx.eval(proposer.propose(anchor, position=context, num_tokens=draft.num_drafts).tokens)
            else:
                out, features = target(candidates[:, :width], cache=cache, tap_ids=tap_ids)
                mx.eval(mx.argmax(out, axis=-1), *([] if features is None else [features]))
                trim_caches(cache, width)
            if repeat:
                samples[width].append(1e3 * (time.perf_counter() - start))
    return {w: round(statistics.median(v), 2) for w, v in samples.items()}


def workload_parser(description: str, variants: list[str]) -> argparse.ArgumentParser:
    """The flags every lookup benchmark takes: the pair (default: the demo pair), workloads, variants."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model")
    parser.add_argument("--draft")
    parser.add_argument("--workloads", default="rename,diff,tool_call,tool_call_s11,json_record")
    parser.add_argument("--variants", default=",".join(variants))
    parser.add_argument("--max-tokens", type=int, default=None, help="Override every workload's max_tokens.")
    return parser


def load_pair(args: argparse.Namespace):
    """--model / --draft in float32, or the demo pair as the commands load it."""
    if args.model:
        return load(args.model, draft=args.draft, dtype="float32")
    demo = demo_pair()
    return load(demo.target, draft=demo.draft, dtype=demo.dtype)


def main() -> None:
    parser = workload_parser(__doc__.splitlines()[0], VARIANTS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    pair = load_pair(args)
    print("cost curve (ms):", json.dumps(cost_curve(pair)))
    specs = json.loads((WORKLOADS / "workloads.json").read_text())
    variants = [v for v in args.variants.split(",") if v]
    for name in args.workloads.split(","):
        request = workload_requests(name, specs[name], pair.tokenizer)
        if request is None:
            print(f"\n{name}: skipped (the tokenizer has no chat template)")
            continue
        constrained = "constraint" in request or "tools" in request
        names = [v for v in variants if constrained or v not in CONSTRAINED_ONLY]
        max_tokens = args.max_tokens or specs[name]["max_tokens"]
        runs: dict[str, list] = {v: [] for v in names}
        for _ in range(args.repeats):
            for variant in names:
                runs[variant].append(generate(pair, max_tokens=max_tokens, **request, **VARIANTS[variant]))
        tokens = {tuple(r.tokens) for rs in runs.values() for r in rs}
        assert len(tokens) == 1, f"{name}: greedy variants disagree"
        first = runs["plain"][0] if "plain" in runs else next(iter(runs.values()))[0]
        prompt_tokens = first.prompt_tokens
        print(f"\n{name}: {len(first.tokens)} tokens, prompt {prompt_tokens} tokens, finish {first.finish_reason}")
        print("| variant | target forwards / 100 tokens | tok/s (median) | tokens per verify round |")
        print("|---|---|---|---|")
        base = statistics.median(r.generation_tps for r in runs[names[0]])
        for variant, rs in runs.items():
            tps = statistics.median(r.generation_tps for r in rs)
            per100 = 100 * rs[0].target_forwards / len(rs[0].tokens)
            per_round = f"{rs[0].mean_acceptance_length:.2f}" if rs[0].rounds else "-"
            print(f"| {variant} | {per100:.1f} | {tps:.1f} ({tps / base:.2f}x) | {per_round} |")


if __name__ == "__main__":
    main()
