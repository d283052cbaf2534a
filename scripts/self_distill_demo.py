"""What self-distillation buys: two drafts for the demo target, one trained on text only, one on the same
text plus the target's own continuations (`mlx_dspark.train.regenerate`), same recipe and steps;
then held-out mean acceptance lengths of both with `mlx_dspark.generate`.

    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/self_distill_demo.py --work /tmp/distill

Corpus and held-out files as `scripts/train_demo_pair.py` (the Python standard library's .py files,
every 20th held out); the target is the shipped demo target (`mlx_dspark/demo/target`, as float32).
Prompts for regeneration: windows of training files the drafts' text does not contain (the other
three quarters), so the distilled records add the target's behaviour, not more copies of the text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_demo_pair import corpus_files, measure  # noqa: E402

import mlx_dspark  # noqa: E402
from mlx_dspark.train.distill import RegenerateOptions, regenerate  # noqa: E402
from mlx_dspark.train.loop import TrainOptions  # noqa: E402
from mlx_dspark.train.session import DataOptions, DraftShape, Precision, train_draft  # noqa: E402

DEMO_TARGET = Path(mlx_dspark.__file__).resolve().parent / "demo" / "target"


def log(message: str) -> None:
    print(f"[distill-demo] {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompts", type=int, default=384, help="regenerated continuations")
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--measure-files", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--variants", default="text,text+distilled", help="comma-separated: text, text+distilled, distilled (the drafts to train)"
    )
    args = parser.parse_args()

    train_files, held_out = corpus_files()
    text = [str(p) for p in train_files[::4]]
    prompt_files = [p for i, p in enumerate(train_files) if i % 4]
    report: dict = {"steps": args.steps, "batch_size": args.batch_size, "anchors": args.anchors, "text_files": len(text)}

    started = time.perf_counter()
    pair = mlx_dspark.load(str(DEMO_TARGET), dtype="float32")
    prompts_dir = args.work / "prompt_files"
    prompts_dir.mkdir(parents=True, exist_ok=True)
    for p in prompt_files[::3]:  # a third of them: enough windows, quick to read
        (prompts_dir / f"{p.parent.name}_{p.name}").write_text(p.read_text(encoding="utf-8", errors="replace"), encoding="utf-8")
    distilled = args.work / "distilled"
    options = RegenerateOptions(
        max_tokens=args.new_tokens, prefix_tokens=64, stride=1024, greedy_fraction=0.5, max_prompts=args.prompts,
        batch_size=16, seed=args.seed,
    )  # fmt: skip
    regenerate(DEMO_TARGET, [prompts_dir], distilled, options=options, target=pair.target, tokenizer=pair.tokenizer, log=log)
    report["regenerate_seconds"] = round(time.perf_counter() - started)
    log(f"regenerated {args.prompts} continuations in {report['regenerate_seconds']} s")

    variants = {"text": ("text only", text), "text+distilled": ("text + self-distilled", text + [str(distilled)]),
                "distilled": ("self-distilled only", [str(distilled)])}  # fmt: skip
    for key in args.variants.split(","):
        name, data = variants[key]
        out = args.work / name.replace(" ", "_").replace("+", "plus")
        started = time.perf_counter()
        train_draft(
            DEMO_TARGET,
            out,
            data=DataOptions(train=data, seq_len=256, batch_size=args.batch_size),
            options=TrainOptions(steps=args.steps, anchors=args.anchors, lr=3e-3, seed=args.seed, progress=False, log_every=25),
            shape=DraftShape(num_layers=3, num_taps=3, sliding_window=128, markov_rank=64, markov_head_type="vanilla"),
            precision=Precision(target_dtype="float32"),
            force=True,
            log=log,
        )
        seconds = round(time.perf_counter() - started)
        acceptance = measure(DEMO_TARGET, out, held_out[: args.measure_files], prompt_tokens=128, max_tokens=128)
        acceptance.pop("sample_output", None)
        report[name] = {"train_seconds": seconds, "acceptance": acceptance}
        log(f"{name}: {json.dumps(report[name])}")
    (args.work / f"report-{args.variants.replace(',', '_').replace('+', '-')}.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
