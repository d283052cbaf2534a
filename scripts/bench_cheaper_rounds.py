"""Issue 20 measurements: what a cheaper draft costs in acceptance, and what it saves per draft block.

    python scripts/bench_cheaper_rounds.py acceptance --out A.json   # the trained demo pair, held-out files
    python scripts/bench_cheaper_rounds.py draft-cost --pair DIR --rank R.json --out B.json   # e.g. the scaled pair

`acceptance`: mean acceptance length (greedy, and T = 1 with sampled drafts) of the demo pair on the
first held-out files of its corpus (scripts/train_demo_pair.py's split: prompt = a file's first 128
tokens, 128 new tokens) for draft precisions (float32, bfloat16, 8 / 4 bits with different parts kept
in float) and reduced vocabularies ranked on the *training* files.
`draft-cost`: median time of one draft block (layers, LM head, Markov steps) at a fixed context, the
variants interleaved in one process (the machine is shared: ratios, not absolute times).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_dspark  # noqa: E402
from mlx_dspark.bench.cost import CostProbe  # noqa: E402
from mlx_dspark.bench.stats import loadavg, median  # noqa: E402
from mlx_dspark.loading.load import load  # noqa: E402
from mlx_dspark.loading.precision import quant_predicate  # noqa: E402
from mlx_dspark.loading.rank_vocab import rank_vocabulary, read_ranked_ids  # noqa: E402
from mlx_dspark.models.heads.draft_vocab import DraftVocabulary  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "mlx_dspark" / "demo"
KEEP = {
    "all": (),
    "markov+conf": ("markov_head", "confidence_head"),
    "markov+conf+fc": ("markov_head", "confidence_head", "fc"),
}


def quantize_draft(pair, bits: int, keep: tuple[str, ...]) -> None:
    nn.quantize(pair.draft, 64, bits, class_predicate=quant_predicate(pair.draft, group_size=64, keep=keep))
    mx.eval(pair.draft.parameters())


def acceptance(args) -> dict:
    from train_demo_pair import corpus_files, read

    train, held_out = corpus_files()
    files = held_out[: args.files]
    rank = Path(args.rank)
    if not rank.is_file():
        rank_vocabulary(DEMO / "target", train, out=rank)
    variants: list[tuple[str, dict]] = [("float32", {}), ("bfloat16", {"dtype": "bfloat16"})]
    for bits in (8, 4):
        for name, keep in KEEP.items():
            variants.append((f"{bits}-bit, float: {name}", {"bits": bits, "keep": keep}))
    for k in args.vocab:
        variants.append((f"vocab {k}", {"vocab": k}))
    results = {}
    for name, variant in variants:
        pair = load(DEMO / "target", DEMO / "draft", dtype="float32", draft_dtype=variant.get("dtype"))
        if "bits" in variant:
            quantize_draft(pair, variant["bits"], variant["keep"])
        if "vocab" in variant:
            ids = read_ranked_ids(rank, size=variant["vocab"], vocab_size=pair.target.args.vocab_size)
            pair.draft.vocabulary = DraftVocabulary(ids, target=pair.target, markov_head=pair.draft.markov_head)
        row = {}
        for mode, options in {"greedy": dict(temperature=0.0), "T=1 sampled": dict(temperature=1.0, draft_sampling="sample", seed=0)}.items():
            lengths = []
            for path in files:
                ids = pair.tokenizer.encode(read(path), add_special_tokens=False)[:128]
                lengths += mlx_dspark.generate(pair, ids, max_tokens=128, **options).acceptance_lengths
            row[mode] = {"mean_acceptance_length": round(sum(lengths) / len(lengths), 3), "rounds": len(lengths)}
        results[name] = row
        print(f"{name:32s} greedy {row['greedy']['mean_acceptance_length']:.3f} ({row['greedy']['rounds']} rounds)  "
              f"T=1 {row['T=1 sampled']['mean_acceptance_length']:.3f} ({row['T=1 sampled']['rounds']} rounds)", flush=True)
    return {"files": len(files), "rank": str(rank), "results": results}


def draft_cost(args) -> dict:
    pair = load(args.pair + "/target", args.pair + "/draft")
    vocab_size = pair.target.args.vocab_size
    probe = CostProbe(pair, context=args.context)
    variants = {"full": None}
    for k in args.vocab:
        ids = read_ranked_ids(Path(args.rank), size=k, vocab_size=vocab_size)
        variants[f"vocab {k}"] = DraftVocabulary(ids, target=pair.target, markov_head=getattr(pair.draft, "markov_head", None))
    samples = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):
        names = list(variants)
        names = names[repeat % len(names):] + names[: repeat % len(names)]
        for name in names:
            pair.draft.vocabulary = variants[name]
            _, total = probe.draft_block()
            if repeat:
                samples[name].append(1000 * total)
    out = {name: round(median(s), 2) for name, s in samples.items()}
    for name, ms in out.items():
        print(f"{name:12s} draft block {ms:.2f} ms ({ms / out['full']:.2f}x)", flush=True)
    return {"context": args.context, "repeats": args.repeats, "draft_block_ms": out, "loadavg": loadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    a = sub.add_parser("acceptance")
    a.add_argument("--files", type=int, default=16)
    a.add_argument("--vocab", type=int, nargs="*", default=[128, 256, 512, 1024])
    a.add_argument("--rank", default="/tmp/demo_vocab_rank.json", help="built from the training files when absent")
    b = sub.add_parser("draft-cost")
    b.add_argument("--pair", required=True)
    b.add_argument("--rank", required=True)
    b.add_argument("--vocab", type=int, nargs="*", default=[4096, 8192, 16384])
    b.add_argument("--context", type=int, default=512)
    b.add_argument("--repeats", type=int, default=20)
    for p in (a, b):
        p.add_argument("--out", required=True)
    args = parser.parse_args()
    start = time.time()
    report = acceptance(args) if args.what == "acceptance" else draft_cost(args)
    report["loadavg_end"] = loadavg()
    report["wall_s"] = round(time.time() - start, 1)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
