"""Issue 25: the controlled-acceptance benchmark on a scaled qwen3_5 hybrid target, beside the scaled Spark pair.

    LD_PRELOAD=libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python scripts/bench_hybrid_controlled.py OUT [--repeats 3]

OUT/hybrid: a qwen3_5 target (mlx-lm's own model behind `models/target/mlx_lm.py`) with the scaled Spark
pair's sizes (36 layers, hidden 512, 8 x 64 query heads, 2 KV heads, intermediate 1024, vocab 32000, tied),
3 GatedDeltaNet layers per full-attention layer (27 + 9), and a random 5-layer windowed DSpark draft
(qwen3 layers, 8 x 64 heads, taps [2, 10, 18, 25, 33], block 7, Markov rank 32). OUT/spark: the scaled
Spark pair (scripts/make_scaled_spark_pair.py). Both written on the first run, reused afterwards.

For each pair, `bench/controlled.run_controlled`: plain and controlled-acceptance runs interleaved, medians,
efficiency = measured / ideal speedup, with the cost curve (decode, draft block, verify widths) printed
beside it. On the hybrid every rollback is timed inside the run: `RollbackCaches.rollback` wrapped, its
restored recurrent / rotating states evaluated before the clock stops (in the engine they would be
evaluated by the next verify: the work is the same, moved earlier), so "rollback ms / round" is the
rollback's share of the measured round.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_dspark  # noqa: E402
from mlx_dspark.bench.controlled import format_controlled, run_controlled, tiled_prompt  # noqa: E402
from mlx_dspark.bench.cost import CostProbe  # noqa: E402
from mlx_dspark.bench.runner import RunSettings, prepare_model  # noqa: E402
from mlx_dspark.bench.stats import median  # noqa: E402
from mlx_dspark.models.caches import rollback as rollback_module  # noqa: E402
from mlx_dspark.testing.mlx_lm_checkpoints import tiny_mlx_lm_config, tiny_mlx_lm_weights, write_draft_for  # noqa: E402
from mlx_dspark.testing.tiny import save_hf_weights  # noqa: E402
from mlx_dspark.testing.tiny_tokenizer import _write_json, write_tokenizer  # noqa: E402

TAP_IDS = [2, 10, 18, 25, 33]


def write_hybrid(out: Path) -> tuple[Path, Path]:
    target, draft = out / "target", out / "draft"
    if (draft / "config.json").exists():
        return target, draft
    target.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(target, family="qwen3")
    config = tiny_mlx_lm_config("qwen3_5", ids)
    config["text_config"].update(
        hidden_size=512, num_hidden_layers=36, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=1024, vocab_size=32000, linear_num_value_heads=8, linear_num_key_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, full_attention_interval=4, tie_word_embeddings=True,
    )  # fmt: skip
    config["tie_word_embeddings"] = True
    _write_json(target / "config.json", config)
    _write_json(target / "generation_config.json", {"bos_token_id": ids["bos"], "eos_token_id": ids["gen_eos"], "pad_token_id": ids["pad"]})
    save_hf_weights(target, tiny_mlx_lm_weights(config, seed=0))
    write_draft_for(
        draft, target_path=target, draft_sizes={"head_dim": 64, "intermediate_size": 1024}, markov_rank=32,
        layer_types=["sliding_attention"] * 5, sliding_window=512, target_layer_ids=TAP_IDS,
    )  # fmt: skip
    return target, draft


class RollbackTimer:
    """Wraps `RollbackCaches.rollback`: each call timed with its restored states evaluated."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self.original = rollback_module.RollbackCaches.rollback
        timer = self

        def timed(caches, n):
            start = time.perf_counter()
            out = timer.original(caches, n)
            arrays = [a for i, c in enumerate(caches) if caches.kinds[i] != rollback_module.TRIM for a in rollback_module.layer_state(c).arrays()]
            mx.eval(arrays)
            if n:
                timer.ms.append(1000 * (time.perf_counter() - start))
            return out

        rollback_module.RollbackCaches.rollback = timed


def cost_curve(loaded, context: int, samples: int = 5) -> dict:
    probe = CostProbe(loaded, context=context)
    block = probe.block_size
    widths = [w for w in (2, 4, block + 1) if w <= block + 1]
    probe.draft_block(), probe.verify(block + 1)  # warm-up
    curve = {f"verify_{w}": median([1000 * probe.verify(w)[1] for _ in range(samples)]) for w in widths}
    curve["draft_block"] = median([1000 * probe.draft_block()[1] for _ in range(samples)])
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--taus", type=float, nargs="+", default=[2.5, 4.55, 6.0])
    parser.add_argument("--pairs", nargs="+", default=["hybrid", "spark"], choices=["hybrid", "spark"])
    args = parser.parse_args()

    spark = args.out / "spark"
    if "spark" in args.pairs and not (spark / "draft" / "config.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).parent / "make_scaled_spark_pair.py"), str(spark)], check=True)
    paths = {"hybrid": write_hybrid(args.out / "hybrid"), "spark": (spark / "target", spark / "draft")}
    timer = RollbackTimer()
    results = {}
    for name in args.pairs:
        target, draft = paths[name]
        loaded = prepare_model(mlx_dspark.load(str(target), str(draft)), RunSettings(ignore_eos=True))
        prompt = tiled_prompt(list(range(3, 300)), args.prompt_len)
        curve = cost_curve(loaded, args.prompt_len + args.max_tokens // 2)
        timer.ms.clear()
        result = run_controlled(loaded, [prompt], acceptance_lengths=args.taus, max_tokens=args.max_tokens, repeats=args.repeats)
        result["cost_curve_ms"] = curve
        result["rollback_ms"] = list(timer.ms)
        results[name] = result
        print(f"== {name}: {target}")
        print("  cost curve (ms, median of 5, context %d): " % (args.prompt_len + args.max_tokens // 2)
              + ", ".join(f"{k} {v:.1f}" for k, v in curve.items()) + f"; decode (plain runs) {result['decode_ms']:.1f}")
        print(format_controlled(result))
        if timer.ms:
            rollback_ms = median(timer.ms)
            round_ms = median([row["round_ms"] for row in result["rows"]])
            print(f"  rollback inside the runs: {len(timer.ms)} rollbacks (n > 0), median {rollback_ms:.1f} ms = "
                  f"{rollback_ms / round_ms:.3f} of the median round ({round_ms:.1f} ms), "
                  f"{rollback_ms / result['verify_ms']:.3f} of a verify of block + 1")
        sys.stdout.flush()
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
